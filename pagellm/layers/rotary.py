"""Rotary position embedding (RoPE) in HF's non-interleaved ("rotate half") layout.

The model turns the step's positions into cos/sin once ([T, D/2] each) and hands
them to every layer, so there is no max-length cos/sin table to keep. Only the
inverse frequencies are stored, as a buffer computed after loading (they are
never in a checkpoint).

RoPE parameters follow the transformers>=5 layout: `config.rope_parameters` is
{"rope_type", "rope_theta", ...scaling keys}, or, for models whose layer types
use different RoPE (Gemma 3), {layer_type: {...}}. One key is ours, valid with
any type: "freq_factors", a divisor per inverse frequency applied after the
type's own scaling (llama.cpp's `freq_factors`: how a GGUF stores Llama 3.1's
scaling, as its rope_freqs.weight tensor).
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Types whose frequencies do not depend on the sequence length ("dynamic" and
# "longrope" change with it: not supported yet).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameter dict that applies to layers of `layer_type` (or to all layers)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise ValueError(f"{type(config).__name__} has no rope_parameters: pagellm reads the transformers>=5 layout")
    if layer_type is not None and layer_type in params:  # nested per layer type
        params = params[layer_type]
    return params


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling, written as HF writes it (so the floats match)."""
    factor = params["factor"]  # 8 in Llama 3.1
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]  # 1, 4
    old_context_len = params["original_max_position_embeddings"]  # 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band in between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, params: dict, max_position_embeddings: int, device) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale cos/sin. As HF computes it."""
    base, original_max = params["rope_theta"], params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dim that turns num_rotations times over original_max
        return head_dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # prevent a division by zero, as HF does
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).to(device=device)  # [D/2]: 1 keeps the original frequency
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def compute_rope(head_dim: int, params: dict, max_position_embeddings: int,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] float32 inverse frequencies, and the factor cos/sin are multiplied by."""
    inv_freq, attention_factor = _scaled_inv_freq(head_dim, params, max_position_embeddings, device)
    if params.get("freq_factors") is not None:
        inv_freq = inv_freq / _freq_factors(params["freq_factors"], head_dim, device)
    return inv_freq, attention_factor


def _freq_factors(factors, head_dim: int, device) -> torch.Tensor:
    """[head_dim / 2] float32 divisors of the inverse frequencies. llama.cpp divides each rotation angle by its
    factor (ggml_rope_ext's freq_factors); dividing the frequency gives the same angle up to float rounding."""
    divisors = torch.as_tensor(factors, dtype=torch.float32, device=device).reshape(-1)
    if divisors.numel() != head_dim // 2:
        raise ValueError(f"rope freq_factors has {divisors.numel()} values; head_dim {head_dim} needs {head_dim // 2}")
    return divisors


def _scaled_inv_freq(head_dim: int, params: dict, max_position_embeddings: int,
                     device) -> tuple[torch.Tensor, float]:
    """compute_rope before freq_factors: the rope type's own frequencies and cos/sin factor."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "yarn":
        return _yarn(head_dim, params, max_position_embeddings, device)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params), 1.0
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int):
        super().__init__()
        # on the CPU, a few values, even inside build_model's meta-device context: meta-device arithmetic runs
        # torch's Python decompositions, which import torch._dynamo (lasting resident memory, layers/embedding.py)
        with torch.device("cpu"):
            _, self.attention_scaling = compute_rope(head_dim, params, max_position_embeddings, device="cpu")
        self.head_dim, self.params, self.max_position_embeddings = head_dim, dict(params), max_position_embeddings
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """(Re)compute the buffer for real: a model built on the meta device calls this after loading."""
        self.inv_freq, _ = compute_rope(self.head_dim, self.params, self.max_position_embeddings, device=device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # [T, D/2]
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

