"""RMSNorm and rotary embedding through fused C++ kernels (csrc/rms_norm.cpp, csrc/rotary.cpp).

A plan binds them where its level has them and the activations' dtype is one they take (kernels/ops.py); inputs
they do not take are then a ValueError, never a silent switch to the torch reference
(kernels/reference/layer_ops.py), which stays the oracle they are tested against. Any layout is taken (a view is
copied contiguous): the halves of Qwen3-Next's gated q projection, the rotated part of a partial rotary.
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import FLOATS, DtypeCode, Flag, Float, Function, Int, Tensor
from pagellm.kernels.cpu.layer_ops import refuse

_RMS_NORM = Function("pagellm_rms_norm", (
    Tensor("x", FLOATS), Tensor("weight", FLOATS), Tensor("out", FLOATS), Int("rows"), Int("dim"), Float("eps"),
    DtypeCode("x"), Flag("unit_offset")))
_ROTARY = Function("pagellm_rotary", (
    Tensor("x", FLOATS), Tensor("cos", FLOATS), Tensor("sin", FLOATS), Tensor("out", FLOATS), Int("tokens"),
    Int("heads"), Int("dim"), DtypeCode("x")))
_LIBRARIES = {"rms_norm": native.Library("rms_norm", [_RMS_NORM], "RMS norm"),
              "rotary": native.Library("rotary", [_ROTARY], "rotary embedding")}
LIBRARIES = tuple(_LIBRARIES.values())  # for kernels/selection.py


def _kernel(name: str, at: str | None):
    """pagellm_<name> of csrc/<name>.cpp at level `at` (unchecked caller), or None."""
    return _LIBRARIES[name].unchecked(f"pagellm_{name}", at)


def available(name: str, at: str | None) -> bool:
    """Whether csrc/<name>.cpp (rms_norm, rotary) runs at level `at`."""
    return _kernel(name, at) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, at: str) -> torch.Tensor:
    """x [..., dim] -> normalised [..., dim]; weight fp32 when unit_offset, else x's dtype."""
    x, weight = x.contiguous(), weight.contiguous()
    if weight.dtype != (torch.float32 if unit_offset else x.dtype) or not _RMS_NORM.accepts(x=x, weight=weight):
        raise refuse("rms_norm", f"x {x.dtype} {tuple(x.shape)}, weight {weight.dtype}")
    out = torch.empty_like(x)
    if x.numel():
        dim = x.shape[-1]
        _kernel("rms_norm", at)(x, weight, out, x.numel() // dim, dim, eps, int(unit_offset))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: str) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2] (same dtype as x)."""
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    if x.dim() != 3 or not cos.dtype == sin.dtype == x.dtype or not _ROTARY.accepts(x=x, cos=cos, sin=sin):
        raise refuse("rotary", f"x {x.dtype} {tuple(x.shape)}, cos {cos.dtype}")
    out = torch.empty_like(x)
    if x.numel():
        tokens, heads, dim = x.shape
        _kernel("rotary", at)(x, cos, sin, out, tokens, heads, dim)
    return out
