"""transformers config classes by model_type, for the tokenizer's conversion by transformers (a cache miss:
loader/tokenizer_conversion.py); the engine reads loader/model_configs.py's, which import no transformers.

transformers' `configuration_llama` imports `utils.type_validators`, whose imports reach torch._dynamo and
triton: ~150 MB resident for good and ~1.3 s at load (docs/benchmarks/2026-11-24-where-the-memory-goes.md), for
nothing the engine runs. Llama is the commonest family of GGUF files (Mistral's files say llama too), so its
config is declared here: the same fields, defaults and model_type as transformers' LlamaConfig, on the same
PreTrainedConfig base (which standardizes rope_theta / rope_scaling into rope_parameters), so everything that
reads a Llama config sees the same attributes. Other families' config modules import nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class LlamaConfig(PretrainedConfig):
    """transformers' LlamaConfig without its module's imports (see the module docstring)."""

    model_type = "llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as attention heads (no grouping)
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None  # None: hidden_size / num_attention_heads

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)


_OWN_CONFIGS: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig}


def config_class(model_type: str) -> type[PretrainedConfig]:
    """The config class for an HF model_type: pagellm's where it has one, else transformers' (imports only that
    family's module)."""
    return _OWN_CONFIGS.get(model_type) or CONFIG_MAPPING[model_type]


def own_config_of_dir(path: str | Path) -> PretrainedConfig | None:
    """An HF checkpoint directory's config.json in pagellm's class for its model_type, or None (no config.json,
    or a family whose config class is transformers')."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    own = _OWN_CONFIGS.get(json.loads(config_file.read_text()).get("model_type"))
    return own.from_pretrained(str(path)) if own is not None else None


def load_config_dir(path: str | Path) -> PretrainedConfig:
    """An HF checkpoint directory's config.json, in pagellm's class where it has one for the model_type."""
    config = own_config_of_dir(path)
    return config if config is not None else AutoConfig.from_pretrained(str(path))
