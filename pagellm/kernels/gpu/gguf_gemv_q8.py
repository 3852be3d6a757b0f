"""The decode gemv on GGUF planes with int8 activations (llama.cpp's q8_1 way on CUDA, its MMVQ), in Triton.

Why: kernels/gpu/gguf_matmul.py's gemv dequantizes every weight to fp32 and multiplies it by an fp32 activation,
about three operations a weight, and a decode gemv runs short of instructions before it runs short of bytes. Here
a call's activations are quantized once, to int8 per 32 columns as the CPU kernels quantize them
(kernels/cpu/csrc/q8_activations.h: d = max |x| / 127, codes x / d rounded half to even), and each 16-column chunk
of a weight row is an integer dot product of its codes with the activations' codes, scaled once per chunk:

    sum_j w_j x_j = d_x (scale sum_j (q_j - zero) a_j + offset sum_j a_j)       (w = scale (q - zero) + offset)

The price is the activations' rounding: up to d_x / 2 each, as on a CPU. Whether it beats bf16 activations is a
device's question (`pagellm bench device-gguf` times both and reports the error beside); until one answers, the
bf16 gemv is the default (BoundPlanesMatmul's int8_activations).

Import only where Triton kernels are wanted (kernels/gpu/layer_ops.py says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.gpu.gguf_tiles import code_zero, codes, factors, store_gemv
from pagellm.kernels.reference.gguf_planes import FORMATS, RUNS, GGUFPlanes

GROUP = 32  # activation columns sharing one scale
QUANTIZE_GROUPS = 32  # groups a quantizing program rounds
ROUNDER = 12582912.0  # 1.5 * 2^23: (v + it) - it is fp32 v rounded half to even, for |v| < 2^22


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, K, s_x, GROUPS: tl.constexpr, ROUND: tl.constexpr):
    """Row m's groups of 32 columns: d = max |x| / 127, q = x / d rounded half to even (0 where d is)."""
    m, block = tl.program_id(0), tl.program_id(1)
    groups = block * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * 32 + tl.arange(0, 32)[None, :]  # [GROUPS, 32]
    ok = cols < K
    x = tl.load(x_ptr + m.to(tl.int64) * s_x + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.max(tl.abs(x), axis=1) / 127.0  # [GROUPS]
    scaled = tl.math.div_rn(x, tl.where(d > 0, d, 1.0)[:, None])  # IEEE division, as the CPU's
    q = tl.minimum(tl.maximum((scaled + ROUND) - ROUND, -127.0), 127.0)
    tl.store(q_ptr + m.to(tl.int64) * K + cols, q.to(tl.int8), mask=ok)
    tl.store(d_ptr + m.to(tl.int64) * (K // 32) + groups, d, mask=groups < K // 32)


@triton.jit
def _chunk_sums(a_ptr, dx_ptr, m_ok, q, c, cc, scale, offset, K, zero, BN: tl.constexpr, C: tl.constexpr):
    """[BM, BN, C] fp32: each chunk's d_x (scale sum (q - zero) a + offset sum a) for one half of a tile."""
    a = tl.load(a_ptr + c[None], mask=m_ok[:, None, None] & (c < K)[None], other=0).to(tl.int32)  # [BM, C, 16]
    dots = tl.sum((q - zero)[None] * a[:, None], axis=3)  # [BM, BN, C] int32: |q - zero| <= 128, |a| <= 127
    sums = tl.sum(a, axis=2)  # [BM, C]
    first = tl.reshape(cc, (C,))
    dx = tl.load(dx_ptr + (first // 32)[None, :], mask=m_ok[:, None] & (first < K)[None, :], other=0.0)  # [BM, C]
    scale, offset = tl.reshape(scale, (BN, C)), tl.reshape(offset, (BN, C))
    return dx[:, None, :] * (scale[None] * dots.to(tl.float32) + offset[None] * sums[:, None, :].to(tl.float32))


@triton.jit
def _gemv_q8_kernel(a_ptr, dx_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, bias_ptr, out_ptr, part_ptr,
                    M, N, K, k_per_split, s_qs, s_qh, s_sc, s_mn, s_d, s_dm, s_out,
                    HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, FMT: tl.constexpr, RUN: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr):
    """out[m, n] (DIRECT: one split, bias added, in out's dtype) or the split's fp32 partial sums, from the
    activations' codes a [M, K] int8 and scales dx [M, K / 32]."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    n_ok = rows < N
    m = tl.arange(0, BM)
    m_ok = m < M
    a_rows = a_ptr + m[:, None, None].to(tl.int64) * K  # [BM, 1, 1]
    dx_rows = dx_ptr + m[:, None].to(tl.int64) * (K // 32)  # [BM, 1]
    zero = code_zero(FMT)
    acc = tl.zeros([BM, BN, BH // 16], dtype=tl.float32)
    start = split * k_per_split
    for k0 in range(start, tl.minimum(start + k_per_split, K), 2 * BH):
        q_lo, q_hi, c_lo, c_hi, cc_lo, cc_hi, ok_lo, ok_hi, r = codes(qs_ptr, qh_ptr, rows, n_ok, k0, K, s_qs, s_qh,
                                                                      FMT, RUN, BH)
        scale, offset = factors(cc_lo, r, ok_lo, d_ptr, dm_ptr, sc_ptr, mn_ptr, s_d, s_dm, s_sc, s_mn, FMT)
        acc += _chunk_sums(a_rows, dx_rows, m_ok, q_lo, c_lo, cc_lo, scale, offset, K, zero, BN, BH // 16)
        scale, offset = factors(cc_hi, r, ok_hi, d_ptr, dm_ptr, sc_ptr, mn_ptr, s_d, s_dm, s_sc, s_mn, FMT)
        acc += _chunk_sums(a_rows, dx_rows, m_ok, q_hi, c_hi, cc_hi, scale, offset, K, zero, BN, BH // 16)
    out = tl.sum(acc, axis=2)  # [BM, BN]
    store_gemv(out, m, m_ok, rows, n_ok, split, M, N, bias_ptr, out_ptr, part_ptr, s_out, HAS_BIAS, DIRECT)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32, rows of unit stride) -> codes [M, K] int8 and scales [M, K / 32] fp32."""
    m, k = x.shape
    if k % GROUP or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows: K {k} must be a multiple of {GROUP}, the rows of unit stride")
    codes_ = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, triton.cdiv(k // GROUP, QUANTIZE_GROUPS))](x, codes_, scales, k, x.stride(0),
                                                                        GROUPS=QUANTIZE_GROUPS, ROUND=ROUNDER)
    return codes_, scales


def launch_gemv_q8(quantized: tuple[torch.Tensor, torch.Tensor], w: GGUFPlanes, bias: torch.Tensor | None,
                   out: torch.Tensor, part: torch.Tensor, tile: tuple[int, int, int], splits: int, per_split: int,
                   strides: tuple[int, ...]) -> None:
    """The gemv's launch (gguf_matmul.BoundPlanesMatmul._gemv chooses the tile and the splits, and reduces)."""
    a, dx = quantized
    (m, k), n = a.shape, w.rows
    bm, bn, bh = tile
    _gemv_q8_kernel[(triton.cdiv(n, bn), splits)](
        a, dx, *w.tensors(), out if bias is None else bias, out, part, m, n, k, per_split, *strides, out.stride(0),
        HAS_BIAS=bias is not None, DIRECT=splits == 1, FMT=FORMATS.index(w.ggml_type), RUN=RUNS[w.ggml_type],
        BM=bm, BN=bn, BH=bh)
