"""Fused decoder-layer ops through csrc/layer_ops.cpp: q/k/v preparation, residual add + RMSNorm, act * up.

A plan binds them where they apply (kernels/ops.py: the level has them, the activations' and K/V cache's dtypes
pair, the head fits), so each call runs the kernel: inputs it does not take are a ValueError, never a silent
switch to the torch ops they replace (kernels/reference/layer_ops.py), which stay the reference the kernels are
tested against. Why fused: at decode every torch op costs dispatch and allocation, and a Gemma 3 layer ran many
of them around its matmuls (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md).
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import (FLOATS, KV_CACHE_FLOATS, DtypeCode, Flag, Float, Function, Int, Tensor,
                                           kv_cache_pairs)

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


def refuse(op: str, why: str) -> ValueError:
    """The error of a kernel given inputs its plan should never have bound it to."""
    return ValueError(f"{op}: {why} (the plan binds this kernel only where it applies)")


def takes_qkv(head_dim: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
    """Whether qkv_prepare takes a layer of `head_dim` with `dtype` activations over a `kv_cache_dtype` cache."""
    return (head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM and dtype in FLOATS and kv_cache_dtype in KV_CACHE_FLOATS
            and kv_cache_pairs(dtype, kv_cache_dtype))


def qkv_prepare(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, at: str) -> torch.Tensor:
    """qkv [T, (H + 2 K) D] -> q [T, H, D], per-head normed (q/k_weight, None: no norm) and rotated by cos/sin
    [T, D/2]; k (normed, rotated) and v are written into the caches at `slots` [T] int64. Norm weights: fp32 when
    unit_offset, else the dtype (as layers/norm.py passes them). `at`: the CPU kernels' level."""
    tokens = qkv.shape[0]
    head_dim = cos.shape[-1] * 2
    norm_dtype = torch.float32 if unit_offset else qkv.dtype
    if not (kv_cache_pairs(qkv.dtype, key_cache.dtype)
            and _QKV_PREPARE.accepts(qkv=qkv, cos=cos, sin=sin, key_cache=key_cache, value_cache=value_cache,
                                     slots=slots, q_weight=q_weight, k_weight=k_weight)
            and cos.dtype == sin.dtype == qkv.dtype and key_cache.dtype == value_cache.dtype
            and qkv.shape[-1] == (num_heads + 2 * num_kv_heads) * head_dim
            and cos.shape == sin.shape and cos.shape[0] == tokens and slots.numel() == tokens
            and key_cache.shape == value_cache.shape and tuple(key_cache.shape[-2:]) == (num_kv_heads, head_dim)
            and all(w is None or (w.dtype == norm_dtype and w.numel() == head_dim) for w in (q_weight, k_weight))):
        raise refuse("qkv_prepare", f"qkv {tuple(qkv.shape)} {qkv.dtype}, cos {tuple(cos.shape)} {cos.dtype}, "
                                    f"cache {tuple(key_cache.shape)} {key_cache.dtype}, slots {slots.dtype}")
    if tokens == 0:
        return qkv.new_empty(0, num_heads, head_dim)
    return qkv_prepare_unchecked(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, unit_offset, cos, sin,
                                 key_cache, value_cache, slots, at)


def qkv_prepare_unchecked(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor,
                          sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slots: torch.Tensor, at: str) -> torch.Tensor:
    """qkv_prepare on inputs the caller has checked (models/bound_layers.py checks once per step); the kernel
    still refuses a slot outside the cache (IndexError) or a head size it cannot hold (ValueError)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1] * 2
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
    status = _call(_QKV_PREPARE, at)(qkv, tokens, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps,
                                     int(unit_offset), cos, sin, key_cache, value_cache, slots,
                                     key_cache.numel() // (num_kv_heads * head_dim), q)
    if status == 2:
        raise IndexError(f"a slot of {slots.tolist()} is outside the KV cache's {key_cache.shape[0]} x "
                         f"{key_cache.shape[1]} slots")
    if status:
        raise refuse("qkv_prepare", f"a head of {head_dim} (at most {MAX_HEAD_DIM})")
    return q


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, unit_offset: bool, at: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + post_norm(x) (post_weight None: x itself), RMSNorm of that sum), each [..., dim]. Both norms
    share eps and flavour; weights fp32 when unit_offset, else the dtype. Views are copied contiguous."""
    norm_dtype = torch.float32 if unit_offset else x.dtype
    residual, x = residual.contiguous(), x.contiguous()
    if (not _ADD_RMS_NORM.accepts(x=x, residual=residual, weight=weight, post_weight=post_weight)
            or residual.dtype != x.dtype or residual.shape != x.shape
            or any(w is not None and w.dtype != norm_dtype for w in (weight, post_weight))):
        raise refuse("add_rms_norm", f"residual {residual.dtype} {tuple(residual.shape)}, x {x.dtype} "
                                     f"{tuple(x.shape)}, weight {weight.dtype}")
    if x.numel() == 0:
        return x.clone(), torch.empty_like(x)
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


def act_mul(gate_up: torch.Tensor, activation: str, at: str) -> torch.Tensor:
    """gate_up [..., 2 I] -> act(gate) * up [..., I] (activation: a key of ACTIVATIONS). A view is copied."""
    gate_up = gate_up.contiguous()
    if activation not in ACTIVATIONS or not _ACT_MUL.accepts(gate_up=gate_up) or gate_up.shape[-1] % 2:
        raise refuse("act_mul", f"{activation!r} on {gate_up.dtype} {tuple(gate_up.shape)}")
    if gate_up.numel() == 0:
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return act_mul_unchecked(gate_up, activation, at)


def act_mul_unchecked(gate_up: torch.Tensor, activation: str, at: str) -> torch.Tensor:
    """act_mul on inputs the caller has checked (every level has the kernel)."""
    half = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], half, dtype=gate_up.dtype)
    if _call(_ACT_MUL, at)(gate_up, gate_up.numel() // (2 * half), half, ACTIVATIONS[activation], out):
        raise refuse("act_mul", f"activation {activation!r}")
    return out
