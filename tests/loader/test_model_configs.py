"""pagellm's model configs (loader/model_configs.py) against transformers' on the same config.json: every value
the model code reads, on config.json files as the families' published checkpoints write them (few keys, the
rest from the family's defaults, rope in the old rope_theta / rope_scaling keys) and on complete ones written by
save_pretrained; and `LLM()` without transformers in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoConfig

from pagellm.loader.model_configs import FAMILIES, load_config_dir
from pagellm.models.llama import head_dim_of
from tests.models.tiny_checkpoints import HYBRID_CONFIGS, TINY_CONFIGS

READ = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "hidden_act", "hidden_activation", "max_position_embeddings",
        "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "sliding_window",
        "layer_types", "bos_token_id", "eos_token_id", "pad_token_id", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "query_pre_attn_scalar", "final_logit_softcapping",
        "attn_logit_softcapping", "use_bidirectional_attention")
MISSING = object()

_GEMMA_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
# As the families' published config.json files have them (values of Llama-3.2-1B, Mistral-7B-v0.1 / v0.3,
# Qwen2.5-0.5B-Instruct, Qwen3-0.6B, Qwen3-30B-A3B, gemma-3-270m / -4b, Qwen3-Next-80B-A3B, Qwen3.5 text).
PUBLISHED = {
    "llama-3.2": {"architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
                  "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
                  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
                  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "tie_word_embeddings": True, "vocab_size": 128256},
    "llama-bare": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
                   "num_attention_heads": 8, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "mistral-v0.1": {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
                     "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                     "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
                     "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                     "vocab_size": 32000},
    "mistral-v0.3": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "rope_theta": 1000000.0,
                     "sliding_window": None, "vocab_size": 32768},
    "qwen2.5": {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
                "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
                "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
                "num_key_value_heads": 2, "rope_theta": 1000000.0, "sliding_window": 32768,
                "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936},
    "qwen2-windowed": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 6,
                       "max_window_layers": 4, "use_sliding_window": True, "sliding_window": 1024},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
              "eos_token_id": 151645, "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
              "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
              "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rope_scaling": None,
              "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_size": 151936},
    "qwen3-yarn": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "max_position_embeddings": 131072,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128,
                  "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
                  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
                  "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                  "num_hidden_layers": 48, "num_key_value_heads": 4, "rope_theta": 1000000.0,
                  "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936},
    "gemma-3-270m": {"_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "bos_token_id": 2,
                     "eos_token_id": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                     "hidden_size": 640, "intermediate_size": 2048, "layer_types": _GEMMA_TYPES * 3,
                     "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
                     "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
                     "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0, "rope_scaling": None,
                     "rope_theta": 1000000.0, "sliding_window": 512, "vocab_size": 262144},
    "gemma-3-4b-text": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
                        "num_hidden_layers": 34, "sliding_window_pattern": 6, "sliding_window": 1024,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "final_logit_softcapping": 30.0},
    "gemma-bidirectional": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                            "num_hidden_layers": 4, "use_bidirectional_attention": True, "sliding_window": 512},
    "qwen3-next": {"architectures": ["Qwen3NextForCausalLM"], "decoder_sparse_step": 1, "eos_token_id": 151645,
                   "full_attention_interval": 4, "head_dim": 256, "hidden_size": 2048, "intermediate_size": 5120,
                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
                   "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
                   "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512,
                   "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
                   "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
                   "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
                   "vocab_size": 151936},
    "qwen3.5-text": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 2048,
                     "num_hidden_layers": 8, "full_attention_interval": 4, "eos_token_id": 248044,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                         "mrope_interleaved": True, "mrope_section": [11, 11, 10]}},
    "qwen3.5-moe-text": {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                         "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"] * 1
                         + ["linear_attention"] * 3 + ["full_attention"], "num_experts": 64, "rope_theta": 1e7},
}


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def assert_same_as_transformers(directory: Path) -> None:
    ours, theirs = load_config_dir(directory), AutoConfig.from_pretrained(str(directory))
    assert type(ours).model_type == theirs.model_type
    for name in READ:
        want = getattr(theirs, name, MISSING)
        if want is MISSING:  # a key this family's transformers class does not have: the model code's default
            continue
        assert _plain(getattr(ours, name, MISSING)) == _plain(want), name
    assert head_dim_of(ours) == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_files_read_as_transformers_reads_them(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    assert_same_as_transformers(tmp_path)


@pytest.mark.parametrize("family", [*TINY_CONFIGS, *HYBRID_CONFIGS])
def test_saved_configs_read_as_transformers_reads_them(tmp_path, family):
    """The tests' tiny checkpoints' configs, as save_pretrained writes them (every key, rope_parameters)."""
    (TINY_CONFIGS | HYBRID_CONFIGS)[family]().save_pretrained(tmp_path)
    assert_same_as_transformers(tmp_path)


def test_every_family_is_covered_and_others_are_a_clear_error(tmp_path):
    covered = {config["model_type"] for config in PUBLISHED.values()}
    assert covered == set(FAMILIES)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ValueError, match="model_type 'falcon' is not supported; supported: llama"):
        load_config_dir(tmp_path)


def test_configs_are_frozen_and_keep_unknown_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED["qwen3"], "some_new_key": 3}))
    config = load_config_dir(tmp_path)
    assert config.some_new_key == 3 and getattr(config, "absent", None) is None
    with pytest.raises(AttributeError):
        config.hidden_size = 1  # frozen: tensor parallel makes a copy (config.replace)
    assert config.replace(hidden_size=8, moe_intermediate_size=4).moe_intermediate_size == 4


def test_llm_imports_no_transformers_on_a_second_start(tmp_path):
    """`import pagellm; LLM(...)` in a fresh interpreter, tokenizer from the start-up cache: no transformers
    module, and nothing that imports torch._dynamo or triton."""
    from tests.models.tiny_checkpoints import write_char_tokenizer, write_tiny_checkpoint

    write_tiny_checkpoint("llama", tmp_path / "model")
    write_char_tokenizer(tmp_path / "model")
    script = textwrap.dedent(f"""
        import sys, pagellm
        llm = pagellm.LLM({str(tmp_path / "model")!r}, kv_cache_memory=0.01)
        llm.generate(["hi"], pagellm.SamplingParams(max_tokens=2), use_tqdm=False)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "triton")
                     or m.startswith("torch._dynamo")))
    """)
    env = {**os.environ, "PAGELLM_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr[-2000:]
    assert "transformers" in runs[0].stdout  # the first start converts the tokenizer with transformers (cached)
    assert runs[1].stdout.strip().splitlines()[-1] == "[]"
