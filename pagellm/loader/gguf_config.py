"""An HF config from a GGUF file's metadata, as llama.cpp reads it (the family's config class: model_configs.py).

Llama 3.1-style rope scaling comes as a tensor, rope_freqs.weight: it goes into the config
(rope_parameters["freq_factors"], see _rope_freq_factors), not into the model's weights. The MoE and hybrid
families' own metadata: gguf_hybrid.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pagellm.loader.gguf_file import GGUFHeader, header_of
from pagellm.loader.gguf_hybrid import HYBRID_ARCHITECTURES, hybrid_config_fields
from pagellm.loader.model_configs import TextModelConfig, config_from_dict

# gguf general.architecture -> (HF config model_type, HF architecture name); the config is the model_type's
# family in loader/model_configs.py.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),  # Mistral GGUFs say llama as well
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    **HYBRID_ARCHITECTURES,
}

# llama.cpp's default base of Gemma 3's sliding-window layers when the file does not state one
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
# llama.cpp's Gemma 3: every 6th layer attends globally, the other five use the sliding window
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
# llama.cpp's per-dimension rope frequency divisors (LLM_TENSOR_ROPE_FREQS): config, not a weight
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def load_gguf_config(path: str | Path | GGUFHeader) -> TextModelConfig:
    """The model family's config (loader/model_configs.py), rebuilt from GGUF metadata as HF names its keys."""
    header = header_of(path)
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {str(path)!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type, hf_architecture = SUPPORTED_ARCHITECTURES[arch]
    fields = {"model_type": model_type, "architectures": [hf_architecture], **_common_fields(header)}
    if arch in HYBRID_ARCHITECTURES:
        fields.update(hybrid_config_fields(header, fields, _rope_parameters(header)))
        return config_from_dict(fields)
    fields["intermediate_size"] = header.required(f"{arch}.feed_forward_length")
    if arch == "gemma3":
        fields.update(_gemma3_fields(header, fields))
    else:
        fields["rope_parameters"] = _rope_parameters(header)
    return config_from_dict(fields)


def _common_fields(header: GGUFHeader) -> dict[str, Any]:
    md, arch = header.metadata, header.architecture

    def key(name: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{name}", default) if default is not None else header.required(f"{arch}.{name}")

    embedding = header.tensor("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{str(header.path)!r} has no token_embd.weight tensor")
    hidden, n_heads = key("embedding_length"), key("attention.head_count")
    return {
        # the embedding's row count is what the weights need; metadata vocab_size may be absent
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": key("attention.key_length", hidden // n_heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        "tie_word_embeddings": header.tensor("output.weight") is None,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_parameters(header: GGUFHeader) -> dict[str, Any]:
    """HF rope_parameters: llama.cpp's base (default 10000), its linear or YaRN scaling and its
    per-dimension frequency factors (rope_freqs.weight: Llama 3.1-style scaling)."""
    md, arch = header.metadata, header.architecture
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(md.get(f"{arch}.rope.freq_base", 1e4))}
    factors = _rope_freq_factors(header)
    if factors is not None:
        params["freq_factors"] = factors  # divides the frequencies after any scaling below, as llama.cpp does
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind is None and md.get(f"{arch}.rope.scale_linear", 1.0) != 1.0:  # older files
        kind, factor = "linear", md[f"{arch}.rope.scale_linear"]
    if kind in (None, "none"):
        return params
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{str(header.path)!r}: rope scaling type {kind!r} is not supported (linear, yarn)")
    params.update(rope_type=kind, factor=float(factor))
    if kind == "yarn":
        optional = {
            "original_max_position_embeddings": "rope.scaling.original_context_length",
            "attention_factor": "rope.scaling.attn_factor",
            "beta_fast": "rope.scaling.yarn_beta_fast",
            "beta_slow": "rope.scaling.yarn_beta_slow",
        }
        params.update({hf: md[f"{arch}.{k}"] for hf, k in optional.items() if f"{arch}.{k}" in md})
    return params


def _rope_freq_factors(header: GGUFHeader) -> list[float] | None:
    """rope_freqs.weight as a list of float32 values (one per frequency), or None when the file has none.

    llama.cpp's converter writes Llama 3.1's rope scaling (HF rope_type "llama3") only as this tensor: the
    factor by which each inverse frequency is divided, and no rope.scaling.* metadata at all, not even the
    original context length. And it computes them with original_max_position_embeddings read from the top
    level of config.json, 8192 when absent, while HF reads the one inside rope_scaling (Llama 3.x configs
    have only that one, also 8192). So we keep the factors rather than fit HF's llama3 parameters back to
    them: dividing by them (layers/rotary.py) is exactly what llama.cpp computes at inference
    (ggml_rope_ext's freq_factors), whatever produced them.
    """
    tensor = header.tensor(ROPE_FREQS_TENSOR)
    if tensor is None:
        return None
    factors = gguf.quants.dequantize(tensor.data, tensor.ggml_type).astype(np.float32).reshape(-1)
    return [float(f) for f in factors]  # exact: every float32 is a Python float


def _gemma3_fields(header: GGUFHeader, common: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3)."""
    md, n_layers = header.metadata, common["num_hidden_layers"]
    full = _rope_parameters(header)  # scaling (e.g. linear x8 on 4B+) applies to global layers only
    local_base = float(md.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))
    local = {"rope_type": "default", "rope_theta": local_base}
    pattern = md.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer files: one bool per layer, true = sliding
        sliding = [bool(p) for p in pattern]
    else:  # a period: layer i is global when (i + 1) % period == 0
        sliding = [(i + 1) % pattern != 0 for i in range(n_layers)]
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(hidden/heads)
    scalar = common["head_dim"]
    if n_layers == 62:
        scalar = common["hidden_size"] // common["num_attention_heads"]
    fields = {
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "sliding_window": header.required("gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
    }
    for hf_key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if f"gemma3.{hf_key}" in md:
            fields[hf_key] = md[f"gemma3.{hf_key}"]
    return fields
