"""pagellm's own Llama config class reads every config as transformers' LlamaConfig does."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig as HFLlamaConfig

from pagellm.loader.hf_configs import LlamaConfig, config_class, load_config_dir
from tests.models.tiny_checkpoints import TINY_CONFIGS

_LLAMA_31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("fields", [
    {},  # every default
    {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128},
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True,
     "mlp_bias": True, "tie_word_embeddings": True, "eos_token_id": [2, 7], "max_position_embeddings": 4096},
    {"rope_theta": 500000.0, "rope_scaling": dict(_LLAMA_31_ROPE)},  # the legacy keys of a Llama 3.1 config.json
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "freq_factors": [1.0, 2.0]},
     "ignore_keys_at_rope_validation": {"freq_factors"}},  # as the GGUF loader builds one with rope_freqs
])
def test_llama_config_matches_transformers(fields):
    ours, theirs = LlamaConfig(**fields), HFLlamaConfig(**fields)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.model_type == theirs.model_type == "llama"


def test_a_checkpoint_directory_loads_through_the_own_class_with_the_same_values(tmp_path):
    TINY_CONFIGS["llama"]().save_pretrained(tmp_path)
    loaded = load_config_dir(tmp_path)
    assert type(loaded) is LlamaConfig
    assert loaded.to_dict() == HFLlamaConfig.from_pretrained(tmp_path).to_dict()


def test_other_families_keep_transformers_classes():
    assert config_class("llama") is LlamaConfig
    assert config_class("qwen3").__module__.startswith("transformers.")
    with pytest.raises(KeyError):
        config_class("no-such-family")
