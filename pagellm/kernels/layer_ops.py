"""Fused decoder-layer ops through csrc/layer_ops.cpp: q/k/v preparation, residual add + RMSNorm, act * up.

Each function returns None when the inputs are not ones the kernel handles (not CPU fp32/bf16, not
contiguous, a KV cache in another dtype, native kernels unavailable); the caller then runs the torch
ops it replaces (pagellm/models/llama.py, pagellm/layers/mlp.py), which stay the reference the kernels
are tested against. Why fused: at decode every torch op costs ~5-10 us of dispatch and allocation, and
a Gemma 3 layer ran ~20 of them around its 7 matmuls.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels import native

_DTYPE_FLAG = native.DTYPE_CODES
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # act_mul's native activations
MAX_HEAD_DIM = 1024  # qkv_prepare's largest head (csrc/layer_ops.cpp kMaxHeadDim)
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pagellm_qkv_prepare": ([_P, _I64, _I64, _I64, _I64, _P, _P, _F, _INT, _P, _P, _P, _P, _P, _I64, _P, _INT], _INT),
    "pagellm_add_rms_norm": ([_P, _P, _P, _P, _P, _P, _I64, _I64, _F, _INT, _INT], None),
    "pagellm_act_mul": ([_P, _I64, _I64, _INT, _P, _INT], _INT),
}


_LIBRARY = native.Library("layer_ops", _SIGNATURES)


def _lib() -> ctypes.CDLL | None:
    """csrc/layer_ops.cpp at the selected level, or None."""
    return _LIBRARY.current()


def _handled(*tensors: torch.Tensor | None) -> bool:
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in _DTYPE_FLAG and first.numel() > 0
            and not (first.requires_grad and torch.is_grad_enabled())  # the kernels have no backward
            and all(t is None or t.is_contiguous() for t in tensors) and _lib() is not None)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def qkv_prepare(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """qkv [T, (H + 2 K) D] -> q [T, H, D], per-head normed (q/k_weight, None: no norm) and rotated by cos/sin
    [T, D/2]; k (normed, rotated) and v are written into the caches at `slots` [T] int64. None: not handled
    (nothing written). Norm weights: fp32 when unit_offset, else the dtype (as layers/norm.py passes them)."""
    tokens = qkv.shape[0]
    head_dim = cos.shape[-1] * 2
    norm_dtype = torch.float32 if unit_offset else qkv.dtype
    kv_row = (num_kv_heads, head_dim)
    if (not _handled(qkv, cos, sin, key_cache, value_cache, slots, q_weight, k_weight)
            or not cos.dtype == sin.dtype == key_cache.dtype == value_cache.dtype == qkv.dtype
            or slots.dtype != torch.int64 or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim
            or cos.shape != sin.shape or cos.shape[0] != tokens or slots.numel() != tokens
            or key_cache.shape != value_cache.shape or tuple(key_cache.shape[-2:]) != kv_row
            or any(w is not None and (w.dtype != norm_dtype or w.numel() != head_dim) for w in (q_weight, k_weight))):
        return None
    return qkv_prepare_unchecked(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, unit_offset, cos, sin,
                                 key_cache, value_cache, slots)


def qkv_prepare_unchecked(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor,
                          sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor | None:
    """qkv_prepare on inputs the caller has checked (models/bound_layers.py checks once per step); the kernel
    still refuses a slot outside the cache (IndexError) or a head size it cannot hold (None)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1] * 2
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
    status = _lib().pagellm_qkv_prepare(
        qkv.data_ptr(), tokens, num_heads, num_kv_heads, head_dim, _pointer(q_weight), _pointer(k_weight), eps,
        int(unit_offset), cos.data_ptr(), sin.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        slots.data_ptr(), key_cache.numel() // (num_kv_heads * head_dim), q.data_ptr(), _DTYPE_FLAG[qkv.dtype])
    if status == 2:
        raise IndexError(f"a slot of {slots.tolist()} is outside the KV cache's {key_cache.shape[0]} x "
                         f"{key_cache.shape[1]} slots")
    return None if status else q


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(residual + post_norm(x) (post_weight None: x itself), RMSNorm of that sum), each [..., dim]. None: not
    handled. Both norms share eps and flavour; weights fp32 when unit_offset, else the dtype."""
    norm_dtype = torch.float32 if unit_offset else x.dtype
    if (not _handled(x, residual, weight, post_weight) or residual.dtype != x.dtype or residual.shape != x.shape
            or any(w is not None and w.dtype != norm_dtype for w in (weight, post_weight))):
        return None
    return add_rms_norm_unchecked(residual, x, post_weight, weight, eps, unit_offset)


def add_rms_norm_unchecked(residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor | None,
                           weight: torch.Tensor, eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm on inputs the caller has checked."""
    new_residual, out = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    _lib().pagellm_add_rms_norm(residual.data_ptr(), x.data_ptr(), _pointer(post_weight), weight.data_ptr(),
                                new_residual.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                                _DTYPE_FLAG[x.dtype], int(unit_offset))
    return new_residual, out


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
    """gate_up [..., 2 I] -> act(gate) * up [..., I] (activation: a key of ACTIVATIONS). None: not handled."""
    if activation not in ACTIVATIONS or not _handled(gate_up):
        return None
    return act_mul_unchecked(gate_up, activation)


def act_mul_unchecked(gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
    """act_mul on inputs the caller has checked (every level has the kernel)."""
    half = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], half, dtype=gate_up.dtype)
    bad = _lib().pagellm_act_mul(gate_up.data_ptr(), gate_up.numel() // (2 * half), half, ACTIVATIONS[activation],
                                 out.data_ptr(), _DTYPE_FLAG[gate_up.dtype])
    return None if bad else out
