"""Model configs of the families pagellm runs: its own frozen dataclasses, read from config.json or GGUF metadata.

Why not transformers' classes: importing them reaches torch._dynamo and triton (~1 s and ~150 MB resident for
good: docs/benchmarks/2026-11-24-where-the-memory-goes.md) for nothing the engine runs. These give the model
code the same attribute values transformers' configs give (field names, family defaults, and its key
normalisation: rope_theta / rope_scaling into `rope_parameters`, layer_types from a family's pattern keys, the
sliding window a family derives); tests/loader/test_model_configs.py holds them to transformers' on real
config.json files.

    config_from_dict(raw)     a config.json's (or GGUF metadata's) dict -> the family's config
    load_config_dir(path)     an HF checkpoint directory's config.json -> the family's config

Keys a family does not declare stay readable as attributes (`extras`): model code reads optional keys with
getattr(config, name, default), as it did on transformers' configs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")  # rope types whose original context length defaults in


@dataclass(frozen=True)
class TextModelConfig:
    """What every family's decoder reads; subclasses set the family's model_type and defaults."""

    model_type: ClassVar[str] = ""
    default_theta: ClassVar[float] = 10000.0

    architectures: tuple[str, ...] = ()
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as attention heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None  # transformers>=5 layout (layers/rotary.py)
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    extras: Mapping[str, Any] = field(default_factory=dict, repr=False)  # keys no field declares

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("architectures", "layer_types", "eos_token_id", "mlp_only_layers"):  # lists in config.json
            value = getattr(self, name, None)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def __getattr__(self, name: str) -> Any:  # only reached for names no field or property has
        extras = self.__dict__.get("extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TextModelConfig:
        """The family's config from a config.json dict: its keys normalised as transformers normalises them."""
        raw = copy.deepcopy(dict(raw))
        raw.pop("model_type", None)
        raw = cls.normalise(raw)
        names = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        known = {k: v for k, v in raw.items() if k in names}
        return cls(**known, extras={k: v for k, v in raw.items() if k not in names})

    @classmethod
    def normalise(cls, raw: dict[str, Any]) -> dict[str, Any]:
        raw["rope_parameters"] = _flat_rope(raw, cls.default_theta)
        return raw

    def replace(self, **changes) -> TextModelConfig:
        """A copy with `changes`, to fields or to extras (tensor parallel's per-rank sizes)."""
        names = {f.name for f in dataclasses.fields(self)}
        extras = {**self.extras, **{k: v for k, v in changes.items() if k not in names}}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if k in names}, extras=extras)

    def to_dict(self) -> dict[str, Any]:
        """As config.json holds it (for transformers' classes, in the bench's HF peers)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        return {**self.extras, **out, "model_type": self.model_type}


def _flat_rope(raw: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """One rope_parameters dict from rope_parameters, or rope_scaling plus rope_theta (transformers' order:
    the dict's own values first, then the top-level keys, then the family's default theta)."""
    params = dict(raw.pop("rope_scaling", None) or raw.get("rope_parameters") or {})
    theta = raw.pop("rope_theta", default_theta)
    partial = raw.pop("partial_rotary_factor", None)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", theta)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in _SCALED_ROPE_TYPES:
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return params


def _qwen_window(raw: dict[str, Any], default_window: int = 4096) -> dict[str, Any]:
    """Qwen2/3 families: the window exists only with use_sliding_window; from max_window_layers layers on."""
    window = raw.get("sliding_window", default_window) if raw.get("use_sliding_window", False) else None
    raw["sliding_window"] = window
    if raw.get("layer_types") is None:
        first = raw.get("max_window_layers", 28)
        raw["layer_types"] = ["sliding_attention" if window is not None and i >= first else "full_attention"
                              for i in range(raw.get("num_hidden_layers", 32))]
    return raw


@dataclass(frozen=True)
class LlamaConfig(TextModelConfig):
    model_type: ClassVar[str] = "llama"
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    mlp_bias: bool = False


@dataclass(frozen=True)
class MistralConfig(TextModelConfig):
    model_type: ClassVar[str] = "mistral"
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096


@dataclass(frozen=True)
class Qwen2Config(TextModelConfig):
    model_type: ClassVar[str] = "qwen2"
    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768

    @classmethod
    def normalise(cls, raw):
        return _qwen_window(super().normalise(raw))


@dataclass(frozen=True)
class Qwen3Config(Qwen2Config):
    model_type: ClassVar[str] = "qwen3"
    head_dim: int | None = 128


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen2Config):
    model_type: ClassVar[str] = "qwen3_moe"
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def normalise(cls, raw):
        if "num_local_experts" in raw:  # transformers' name for it
            raw.setdefault("num_experts", raw.pop("num_local_experts"))
        raw = super().normalise(raw)
        if not raw.get("use_sliding_window", False):  # transformers keeps no layer_types for this family
            raw.pop("layer_types", None)
        return raw


@dataclass(frozen=True)
class Gemma3TextConfig(TextModelConfig):
    model_type: ClassVar[str] = "gemma3_text"
    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = 0
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False

    @classmethod
    def normalise(cls, raw):
        if raw.get("use_bidirectional_attention"):  # transformers stores the window's exclusive bound
            raw["sliding_window"] = raw.get("sliding_window", 4096) // 2 + 1
        pattern = raw.pop("sliding_window_pattern", raw.pop("_sliding_window_pattern", 6))
        if raw.get("layer_types") is None:
            raw["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(raw.get("num_hidden_layers", 26))]
        raw["rope_parameters"] = _gemma3_rope(raw)
        return raw


def _gemma3_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Per layer type: global layers at rope_theta (1M) with any rope_scaling, local ones at rope_local_base_freq."""
    params = copy.deepcopy(raw.get("rope_parameters")) or {}
    full = params.get("full_attention") or {"rope_type": "default"}
    full.update(raw.pop("rope_scaling", None) or {})
    full.setdefault("rope_theta", raw.pop("rope_theta", 1_000_000.0))
    local = params.get("sliding_attention") or {"rope_type": "default"}
    local.setdefault("rope_theta", raw.pop("rope_local_base_freq", 10_000.0))
    for layer_params in (full, local):
        layer_params.setdefault("rope_type", layer_params.get("type", "default"))
        if layer_params["rope_type"] in _SCALED_ROPE_TYPES:
            layer_params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 131072))
    return {"sliding_attention": local, "full_attention": full}


@dataclass(frozen=True)
class _GatedDeltaNetConfig(TextModelConfig):
    """Qwen3-Next and Qwen3.5: Gated DeltaNet layers with a full attention layer every full_attention_interval."""

    max_position_embeddings: int = 32768
    head_dim: int | None = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    @classmethod
    def normalise(cls, raw):
        raw.setdefault("partial_rotary_factor", 0.25)
        interval = raw.pop("full_attention_interval", 4)
        if raw.get("layer_types") is None:
            raw["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                                  for i in range(raw.get("num_hidden_layers", cls.num_hidden_layers))]
        return super().normalise(raw)


@dataclass(frozen=True)
class _GatedDeltaNetMoeConfig(_GatedDeltaNetConfig):
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Qwen3NextConfig(_GatedDeltaNetMoeConfig):
    model_type: ClassVar[str] = "qwen3_next"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class Qwen3_5TextConfig(_GatedDeltaNetConfig):
    model_type: ClassVar[str] = "qwen3_5_text"
    vocab_size: int = 248320
    intermediate_size: int = 12288
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4


@dataclass(frozen=True)
class Qwen3_5MoeTextConfig(_GatedDeltaNetMoeConfig):
    model_type: ClassVar[str] = "qwen3_5_moe_text"
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    num_experts_per_tok: int = 8
    num_experts: int = 256


FAMILIES: Mapping[str, type[TextModelConfig]] = {cls.model_type: cls for cls in (
    LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig, Gemma3TextConfig, Qwen3NextConfig,
    Qwen3_5TextConfig, Qwen3_5MoeTextConfig)}


def config_from_dict(raw: Mapping[str, Any]) -> TextModelConfig:
    """A config.json's dict (or GGUF metadata turned into one) -> its family's config; ValueError for others."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type].from_dict(raw)


def load_config_dir(path: str | Path) -> TextModelConfig:
    """An HF checkpoint directory's config.json -> its family's config."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json")
    return config_from_dict(json.loads(config_file.read_text()))
