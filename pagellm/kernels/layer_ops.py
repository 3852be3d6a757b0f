"""Fused decoder-layer ops through csrc/layer_ops.cpp: q/k/v preparation, residual add + RMSNorm, act * up.

Each function returns None when the inputs are not ones the kernel handles (not CPU fp32/bf16, not
contiguous, a KV cache in a dtype not paired with the activations' (binding.kv_cache_pairs), native kernels
unavailable); the caller then runs the torch ops it replaces (pagellm/models/llama.py, pagellm/layers/mlp.py), which stay the reference the kernels
are tested against. Why fused: at decode every torch op costs dispatch and allocation, and a Gemma 3
layer ran many of them around its matmuls (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md).
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels import cuda_ops, native
from pagellm.kernels.binding import FLOATS, KV_CACHE_FLOATS, DtypeCode, Flag, Float, Function, Int, Tensor, kv_cache_pairs

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # act_mul's native activations
MAX_HEAD_DIM = 1024  # qkv_prepare's largest head (csrc/layer_ops.cpp kMaxHeadDim)
_QKV_PREPARE = Function("pagellm_qkv_prepare", (
    Tensor("qkv", FLOATS), Int("tokens"), Int("heads"), Int("kv_heads"), Int("head_dim"),
    Tensor("q_weight", FLOATS, optional=True), Tensor("k_weight", FLOATS, optional=True), Float("eps"),
    Flag("unit_offset"), Tensor("cos", FLOATS), Tensor("sin", FLOATS), Tensor("key_cache", KV_CACHE_FLOATS),
    Tensor("value_cache", KV_CACHE_FLOATS), Tensor("slots", (torch.int64,)), Int("num_slots"), Tensor("q_out", FLOATS),
    DtypeCode("qkv"), DtypeCode("key_cache")), returns=ctypes.c_int)
_ADD_RMS_NORM = Function("pagellm_add_rms_norm", (
    Tensor("residual", FLOATS), Tensor("x", FLOATS), Tensor("post_weight", FLOATS, optional=True),
    Tensor("weight", FLOATS), Tensor("residual_out", FLOATS), Tensor("out", FLOATS), Int("rows"), Int("dim"),
    Float("eps"), DtypeCode("x"), Flag("unit_offset")))
_ACT_MUL = Function("pagellm_act_mul", (
    Tensor("gate_up", FLOATS), Int("rows"), Int("n"), Flag("act"), Tensor("out", FLOATS), DtypeCode("gate_up")),
    returns=ctypes.c_int)
_LIBRARY = native.Library("layer_ops", [_QKV_PREPARE, _ADD_RMS_NORM, _ACT_MUL], "fused layer ops")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py


def native_available(at: str | None) -> bool:
    """Whether the fused layer ops' native kernels run at level `at` (built; None: native kernels off)."""
    return _LIBRARY.at(at) is not None


def _call(function: Function, at: str):
    return _LIBRARY.unchecked(function.symbol, at)


def qkv_prepare(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                at: str | None) -> torch.Tensor | None:
    """qkv [T, (H + 2 K) D] -> q [T, H, D], per-head normed (q/k_weight, None: no norm) and rotated by cos/sin
    [T, D/2]; k (normed, rotated) and v are written into the caches at `slots` [T] int64. None: not handled
    (nothing written). Norm weights: fp32 when unit_offset, else the dtype (as layers/norm.py passes them). `at`:
    the CPU kernels' level (None: off); CUDA tensors go to the Triton kernel whatever it is."""
    tokens = qkv.shape[0]
    head_dim = cos.shape[-1] * 2
    norm_dtype = torch.float32 if unit_offset else qkv.dtype
    kv_row = (num_kv_heads, head_dim)
    on_cuda = qkv.is_cuda
    if on_cuda:  # the Triton kernel takes any float cache dtype (stored as it converts)
        handled = (cuda_ops.takes(qkv, cos, sin, key_cache, value_cache, q_weight, k_weight)
                   and slots.is_cuda and slots.dtype == torch.int64)
    else:
        handled = (native_available(at) and kv_cache_pairs(qkv.dtype, key_cache.dtype)
                   and _QKV_PREPARE.accepts(qkv=qkv, cos=cos, sin=sin, key_cache=key_cache, value_cache=value_cache,
                                            slots=slots, q_weight=q_weight, k_weight=k_weight))
    if (not handled or qkv.numel() == 0 or not cos.dtype == sin.dtype == qkv.dtype
            or key_cache.dtype != value_cache.dtype
            or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim
            or cos.shape != sin.shape or cos.shape[0] != tokens or slots.numel() != tokens
            or key_cache.shape != value_cache.shape or tuple(key_cache.shape[-2:]) != kv_row
            or any(w is not None and (w.dtype != norm_dtype or w.numel() != head_dim) for w in (q_weight, k_weight))):
        return None
    if on_cuda:
        return cuda_ops.layer_ops().qkv_prepare(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, unit_offset,
                                                cos, sin, key_cache, value_cache, slots)
    return qkv_prepare_unchecked(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, unit_offset, cos, sin,
                                 key_cache, value_cache, slots, at)


def qkv_prepare_unchecked(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor,
                          sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slots: torch.Tensor, at: str) -> torch.Tensor | None:
    """qkv_prepare on inputs the caller has checked (models/bound_layers.py checks once per step); the kernel
    still refuses a slot outside the cache (IndexError) or a head size it cannot hold (None)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1] * 2
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
    status = _call(_QKV_PREPARE, at)(qkv, tokens, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps,
                                 int(unit_offset), cos, sin, key_cache, value_cache, slots,
                                 key_cache.numel() // (num_kv_heads * head_dim), q)
    if status == 2:
        raise IndexError(f"a slot of {slots.tolist()} is outside the KV cache's {key_cache.shape[0]} x "
                         f"{key_cache.shape[1]} slots")
    return None if status else q


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, unit_offset: bool, at: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(residual + post_norm(x) (post_weight None: x itself), RMSNorm of that sum), each [..., dim]. None: not
    handled. Both norms share eps and flavour; weights fp32 when unit_offset, else the dtype."""
    norm_dtype = torch.float32 if unit_offset else x.dtype
    if x.is_cuda:
        if (cuda_ops.takes(residual, x, weight, post_weight) and residual.dtype == x.dtype
                and residual.shape == x.shape
                and all(w is None or w.dtype == norm_dtype for w in (weight, post_weight))):
            return cuda_ops.layer_ops().add_rms_norm(residual, x, post_weight, weight, eps, unit_offset)
        return None
    if (x.numel() == 0 or not native_available(at)
            or not _ADD_RMS_NORM.accepts(x=x, residual=residual, weight=weight, post_weight=post_weight)
            or residual.dtype != x.dtype or residual.shape != x.shape
            or any(w is not None and w.dtype != norm_dtype for w in (weight, post_weight))):
        return None
    return add_rms_norm_unchecked(residual, x, post_weight, weight, eps, unit_offset, at)


def add_rms_norm_unchecked(residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor | None,
                           weight: torch.Tensor, eps: float, unit_offset: bool,
                           at: str) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm on inputs the caller has checked."""
    new_residual, out = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    _call(_ADD_RMS_NORM, at)(residual, x, post_weight, weight, new_residual, out, x.numel() // dim, dim, eps,
                         int(unit_offset))
    return new_residual, out


def act_mul(gate_up: torch.Tensor, activation: str, at: str | None) -> torch.Tensor | None:
    """gate_up [..., 2 I] -> act(gate) * up [..., I] (activation: a key of ACTIVATIONS). None: not handled."""
    if gate_up.is_cuda:
        ok = activation in ACTIVATIONS and cuda_ops.takes(gate_up) and gate_up.shape[-1] % 2 == 0
        return cuda_ops.layer_ops().act_mul(gate_up, activation) if ok else None
    if (activation not in ACTIVATIONS or gate_up.numel() == 0 or not native_available(at)
            or not _ACT_MUL.accepts(gate_up=gate_up)):
        return None
    return act_mul_unchecked(gate_up, activation, at)


def act_mul_unchecked(gate_up: torch.Tensor, activation: str, at: str) -> torch.Tensor | None:
    """act_mul on inputs the caller has checked (every level has the kernel)."""
    half = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], half, dtype=gate_up.dtype)
    bad = _call(_ACT_MUL, at)(gate_up, gate_up.numel() // (2 * half), half, ACTIVATIONS[activation], out)
    return None if bad else out
