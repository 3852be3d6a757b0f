"""Rotary position embedding (RoPE) in HF's non-interleaved ("rotate half") layout.

The model turns the step's positions into cos/sin once ([T, D/2] each) and hands
them to every layer, so there is no max-length cos/sin table to keep. Only the
inverse frequencies are stored, as a buffer computed after loading (they are
never in a checkpoint).

RoPE parameters follow the transformers>=5 layout: `config.rope_parameters` is
{"rope_type", "rope_theta", ...scaling keys}, or, for models whose layer types
use different RoPE (Gemma 3), {layer_type: {...}}.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Types whose frequencies do not depend on the sequence length ("dynamic" and
# "longrope" change with it, "yarn" also rescales attention: not supported yet).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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


def compute_inv_freq(head_dim: int, params: dict, device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies for one RoPE parameter dict."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict):
        super().__init__()
        compute_inv_freq(head_dim, params, device="meta")  # reject an unsupported config at build time
        self.head_dim, self.params = head_dim, dict(params)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """(Re)compute the buffer for real: a model built on the meta device calls this after loading."""
        self.inv_freq = compute_inv_freq(self.head_dim, self.params, device=device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # [T, D/2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2]; same arithmetic as HF's rotate_half form."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]
