"""The fused decoder-layer ops for CUDA in Triton: residual add + RMSNorm, q/k/v preparation (per-head norm,
rotary, K/V written at their slots), act * up.

Why: on a GPU an eager step is bound by the host, and the torch reference of these ops launched several kernels
each (measured on an H200: docs/benchmarks/2026-11-26-gpu-h200.md). Fused, a Llama layer is nine launches: two
norms, one q/k/v preparation, one act * up, four matmuls, one attention (and its reduce in a split decode).

Each kernel rounds where the torch reference (kernels/reference/layer_ops.py) rounds, in the
activations' dtype, so bf16 results follow HF's order of operations; the arithmetic between roundings is fp32,
compiled without FP fusion (a fused multiply-add skips the rounding of its product, which torch's separate ops
keep; these kernels are bound by memory, not by arithmetic).
The torch ops stay the oracle (tests/gpu/test_triton_layer_ops.py, under TRITON_INTERPRET=1 on a CPU).

Import this module only where Triton kernels are wanted: `triton.jit` reads TRITON_INTERPRET when the module is
imported (kernels/ops.triton_ops imports it when a CUDA backend plans its first model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the activations and K/V caches these kernels take


@triton.jit
def _rms_norm(x, w_ptr, cols, ok, dim, eps, DTYPE: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """x [BLOCK] fp32 (values of DTYPE) -> its RMSNorm, rounded to DTYPE and back to fp32. Llama's flavour
    rounds the normalised row before the weight; Gemma's scales by (1 + w) in fp32 (layers/norm.py)."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return (normed * (1.0 + w)).to(DTYPE).to(tl.float32)
    return (w * normed.to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(res_ptr, x_ptr, post_w_ptr, w_ptr, res_out_ptr, out_ptr, dim, eps,
                         stride_res, stride_x, stride_res_out, stride_out,
                         HAS_X: tl.constexpr, HAS_POST: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One row: h = res + post_norm(x) (or + x, or res alone), stored when x is given; out = norm(h)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dtype = out_ptr.dtype.element_ty
    h = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_POST:
            x = _rms_norm(x, post_w_ptr, cols, ok, dim, eps, dtype, UNIT_OFFSET)
        h = (h + x).to(dtype).to(tl.float32)
        tl.store(res_out_ptr + row * stride_res_out + cols, h.to(dtype), mask=ok)
    out = _rms_norm(h, w_ptr, cols, ok, dim, eps, dtype, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=ok)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor | None, post_weight: torch.Tensor | None,
                 weight: torch.Tensor, eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + post_norm(x), RMSNorm of that sum), each [..., dim]; x None: (residual, its norm). The same
    contract as kernels/cpu/layer_ops.add_rms_norm; rows of unit stride (the caller checks)."""
    dim = residual.shape[-1]
    rows = residual.reshape(-1, dim)
    xs = rows if x is None else x.reshape(-1, dim)
    out = torch.empty_like(rows)
    new_residual = rows if x is None else torch.empty_like(rows)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, xs, weight if post_weight is None else post_weight, weight, new_residual, out, dim, eps,
            rows.stride(0), xs.stride(0), new_residual.stride(0), out.stride(0),
            HAS_X=x is not None, HAS_POST=post_weight is not None, UNIT_OFFSET=unit_offset,
            BLOCK=triton.next_power_of_2(dim), enable_fp_fusion=False)
    return new_residual.view(residual.shape), out.view(residual.shape)


@triton.jit
def _qkv_prepare_kernel(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                        q_out_ptr, eps, stride_qkv, stride_cos, stride_q_t,
                        H: tl.constexpr, K: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
                        HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Program (token, head of the H + 2K in qkv): a q head is normed, rotated and stored in q_out; a k head
    the same, stored at the token's slot in k_cache; a v head copied to v_cache. A slot < 0 writes nothing
    (a padded row)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    cols = tl.arange(0, HALF_BLOCK)
    ok = cols < half
    dtype = q_out_ptr.dtype.element_ty
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)  # [D/2] first half, [D/2] second: rotate_half
    x2 = tl.load(row + half + cols, mask=ok, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + token)
    if head >= H + K:  # a v head
        if slot >= 0:
            dst = v_cache_ptr + slot * (K * HEAD_DIM) + (head - H - K) * HEAD_DIM
            tl.store(dst + cols, x1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + half + cols, x2.to(v_cache_ptr.dtype.element_ty), mask=ok)
    else:
        if HAS_NORM:  # RMSNorm over the whole head, halves together
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
            if head < H:
                w1 = tl.load(q_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(q_w_ptr + half + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(k_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(k_w_ptr + half + cols, mask=ok, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                x1 = ((x1 * inv) * (1.0 + w1)).to(dtype).to(tl.float32)
                x2 = ((x2 * inv) * (1.0 + w2)).to(dtype).to(tl.float32)
            else:
                x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        c = tl.load(cos_ptr + token * stride_cos + cols, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + token * stride_cos + cols, mask=ok, other=0.0).to(tl.float32)
        # x1 * cos - x2 * sin, x2 * cos + x1 * sin: each product and sum rounded, as the torch ops round them
        o1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
        if head < H:
            dst = q_out_ptr + token * stride_q_t + head * HEAD_DIM
            tl.store(dst + cols, o1, mask=ok)
            tl.store(dst + half + cols, o2, mask=ok)
        elif slot >= 0:
            dst = k_cache_ptr + slot * (K * HEAD_DIM) + (head - H) * HEAD_DIM
            tl.store(dst + cols, o1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + half + cols, o2.to(k_cache_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [..., dim] -> its RMSNorm: the fused add + norm's kernel, with nothing to add."""
    return add_rms_norm(x.contiguous(), None, None, weight.contiguous(), eps, unit_offset)[1]


def pairs(dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
    """Whether qkv_prepare and paged attention take `dtype` activations over a `kv_cache_dtype` cache (any float
    cache: stored as it converts)."""
    return dtype in FLOATS and kv_cache_dtype in FLOATS


def head_dim_ok(head_dim: int) -> bool:
    """Whether they take heads of `head_dim` (rotated in halves)."""
    return head_dim % 2 == 0


def takes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
    """Whether they take a layer of `head_dim` with `dtype` activations over a `kv_cache_dtype` cache."""
    return head_dim_ok(head_dim) and pairs(dtype, kv_cache_dtype)


def qkv_prepare(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                k_weight: torch.Tensor | None, eps: float, unit_offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """qkv [T, (H + 2 K) D] -> q [T, H, D]; k and v written at `slots` [T] int64 of the contiguous caches
    [blocks, block_size, K, D]. The contract of kernels/cpu/layer_ops.qkv_prepare (the caller checks shapes)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1] * 2
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _qkv_prepare_kernel[(tokens, num_heads + 2 * num_kv_heads)](
            qkv, q_weight if q_weight is not None else cos, k_weight if k_weight is not None else cos, cos, sin,
            key_cache, value_cache, slots, q, eps, qkv.stride(0), cos.stride(0), q.stride(0),
            H=num_heads, K=num_kv_heads, HEAD_DIM=head_dim, HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
            HAS_NORM=q_weight is not None, UNIT_OFFSET=unit_offset, enable_fp_fusion=False)
    return q


@triton.jit
def _act_mul_kernel(gate_up_ptr, out_ptr, n, stride_in, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column tile): out = act(gate) * up, act rounded first (F.silu / F.gelu then `*`)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        act = gate / (1.0 + tl.exp(-gate))
    else:  # gelu, tanh approximation; tanh through exp (tl has no tanh in every version we target)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)))
    tl.store(out_ptr + row * stride_out + cols, (act.to(dtype).to(tl.float32) * up).to(dtype), mask=ok)


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [..., 2 I] -> act(gate) * up [..., I] (activation: a key of ACTIVATIONS)."""
    half = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * half)
    out = torch.empty(rows.shape[0], half, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(half))
        _act_mul_kernel[(rows.shape[0], triton.cdiv(half, block))](
            rows, out, half, rows.stride(0), out.stride(0), ACT=ACTIVATIONS[activation], BLOCK=block,
            enable_fp_fusion=False)
    return out.view(*gate_up.shape[:-1], half)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    """One row (a token's value head): (w * rms_norm(x)) * silu(gate), rounded where the torch module rounds."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)).to(dtype).to(tl.float32)
    scaled = (tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed).to(dtype).to(tl.float32)
    gate = tl.load(gate_ptr + row * dim + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (scaled * (gate / (1.0 + tl.exp(-gate)))).to(dtype), mask=ok)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., dim] -> (weight * rms_norm(x)) * silu(gate) in x's dtype: the Gated DeltaNet's output norm in
    one launch (its torch module takes five), the contract of layers/gated_delta_net.GatedRMSNorm."""
    if not (x.dtype == gate.dtype == weight.dtype and x.shape == gate.shape):
        raise ValueError(f"gated_rms_norm: x {x.dtype} {list(x.shape)}, gate {gate.dtype} {list(gate.shape)} and "
                         f"weight {weight.dtype} must agree")
    dim = x.shape[-1]
    rows, gates = x.reshape(-1, dim).contiguous(), gate.reshape(-1, dim).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, dim, eps,
                                                 BLOCK=triton.next_power_of_2(dim), enable_fp_fusion=False)
    return out.view(x.shape)
