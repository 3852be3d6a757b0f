"""RMSNorm and rotary embedding through fused C++ kernels (csrc/rms_norm.cpp, csrc/rotary.cpp).

Each function returns None where its level has no kernel or the dtypes are not ones it takes, both known when a
plan binds the level; the caller then runs the torch reference (pagellm/layers/norm.py, pagellm/layers/rotary.py),
which stays the oracle the kernels are tested against. Any layout is taken (a view is copied contiguous):
tests/models/test_module_path_fallbacks.py holds that no family's step declines.
"""

from __future__ import annotations

import torch

from pagellm.kernels import cuda_ops, native
from pagellm.kernels.binding import FLOATS, DtypeCode, Flag, Float, Function, Int, Tensor

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
             at: str | None) -> torch.Tensor | None:
    """x [..., dim] -> normalised [..., dim]; weight fp32 when unit_offset, else x's dtype. None: not handled (the
    level has no kernel, a dtype it does not take: known when planning). Any layout: a view (a q half of a gated
    projection) is copied contiguous, which costs less than the reference's ops."""
    if weight.dtype != (torch.float32 if unit_offset else x.dtype):
        return None
    if x.is_cuda:  # the Triton kernel of the fused add + norm, with nothing to add
        x, weight = x.contiguous(), weight.contiguous()
        ok = cuda_ops.takes(x, weight)
        return cuda_ops.layer_ops().add_rms_norm(x, None, None, weight, eps, unit_offset)[1] if ok else None
    fn = _kernel("rms_norm", at)
    if fn is None or x.numel() == 0:
        return None
    x, weight = x.contiguous(), weight.contiguous()  # after the checks that decline: no copy for the reference
    if not _RMS_NORM.accepts(x=x, weight=weight):
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    fn(x, weight, out, x.numel() // dim, dim, eps, int(unit_offset))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: str | None) -> torch.Tensor | None:
    """x [T, H, D] rotated by cos/sin [T, D/2] (same dtype as x). None: not handled (no kernel at the level, a
    dtype it does not take). Any layout: a view (the rotated part of a partial rotary) is copied contiguous."""
    fn = None if x.is_cuda else _kernel("rotary", at)  # on CUDA the fused qkv_prepare rotates, or the reference
    if fn is None or x.dim() != 3 or x.numel() == 0 or not cos.dtype == sin.dtype == x.dtype:
        return None
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()  # after the checks that decline
    if not _ROTARY.accepts(x=x, cos=cos, sin=sin):
        return None
    out = torch.empty_like(x)
    tokens, heads, dim = x.shape
    fn(x, cos, sin, out, tokens, heads, dim)
    return out
