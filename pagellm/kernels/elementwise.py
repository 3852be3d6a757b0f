"""RMSNorm and rotary embedding through fused C++ kernels (csrc/rms_norm.cpp, csrc/rotary.cpp).

Each function returns None when the inputs are not ones the kernel handles (not
on CPU, not fp32/bf16, not contiguous, native kernels unavailable); the caller
then runs the torch reference (pagellm/layers/norm.py, pagellm/layers/rotary.py),
which stays the oracle the kernels are tested against.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels import native

_DTYPE_FLAG = native.DTYPE_CODES
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # library (csrc/<name>.cpp) -> its function's argtypes
    "rms_norm": [_P, _P, _P, _I64, _I64, ctypes.c_float, _INT, _INT],
    "rotary": [_P, _P, _P, _P, _I64, _I64, _I64, _INT],
}


_LIBRARIES = {name: native.Library(name, {f"pagellm_{name}": (argtypes, None)}) for name, argtypes in _SIGNATURES.items()}


def _kernel(name: str):
    """pagellm_<name> of csrc/<name>.cpp at the selected level, or None."""
    return _LIBRARIES[name].function(f"pagellm_{name}")


def _handled(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in _DTYPE_FLAG and first.numel() > 0
            and not (first.requires_grad and torch.is_grad_enabled())  # the kernels have no backward
            and all(t.is_contiguous() for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor | None:
    """x [..., dim] -> normalised [..., dim]; weight fp32 when unit_offset, else x's dtype. None: not handled."""
    if not _handled(x, weight) or weight.dtype != (torch.float32 if unit_offset else x.dtype):
        return None
    fn = _kernel("rms_norm")
    if fn is None:
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
       _DTYPE_FLAG[x.dtype], int(unit_offset))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] rotated by cos/sin [T, D/2] (same dtype as x). None: not handled."""
    if x.dim() != 3 or not _handled(x, cos, sin) or not cos.dtype == sin.dtype == x.dtype:
        return None
    fn = _kernel("rotary")
    if fn is None:
        return None
    out = torch.empty_like(x)
    tokens, heads, dim = x.shape
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads, dim, _DTYPE_FLAG[x.dtype])
    return out
