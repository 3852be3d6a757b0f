"""The GGUF planes' codes and factors as the Triton kernels read them (kernels/gpu/gguf_matmul.py's gemv, tile and
dequantization kernels, kernels/gpu/gguf_gemv_q8.py's int8-activation gemv, kernels/gpu/moe.py's grouped
experts): one place that knows each format's layout (kernels/reference/gguf_planes.py, the oracle).

Import only where Triton kernels are wanted (kernels/gpu/layer_ops.py says why).
"""

from __future__ import annotations

import triton
import triton.language as tl

# FMT: a format's index in FORMATS (0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0, 5 Q4_K, 6 Q5_K, 7 Q6_K)


@triton.jit
def factors(cc, r, ok, d_ptr, dm_ptr, sc_ptr, mn_ptr, s_d, s_dm, s_sc, s_mn, FMT: tl.constexpr):
    """(scale, offset) [BN, C, 1] of the 16-column chunks starting at columns cc [C, 1] of rows r [BN, 1, 1]: a
    weight is scale (q - zero) + offset. One load per chunk, not per weight: a decode gemv runs short of
    instructions before it runs short of arithmetic."""
    if FMT == 5 or FMT == 6:  # Q4_K, Q5_K: d sc, -(dmin mn)
        d = tl.load(d_ptr + r * s_d + (cc // 256)[None], mask=ok, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + r * s_sc + (cc // 32)[None], mask=ok, other=0).to(tl.float32)
        dm = tl.load(dm_ptr + r * s_dm + (cc // 256)[None], mask=ok, other=0.0).to(tl.float32)
        mn = tl.load(mn_ptr + r * s_mn + (cc // 32)[None], mask=ok, other=0).to(tl.float32)
        return d * sc, -(dm * mn)
    if FMT == 7:  # Q6_K: d sc per 16 columns
        d = tl.load(d_ptr + r * s_d + (cc // 256)[None], mask=ok, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + r * s_sc + (cc // 16)[None], mask=ok, other=0).to(tl.float32)
        return d * sc, tl.zeros_like(d)
    d = tl.load(d_ptr + r * s_d + (cc // 32)[None], mask=ok, other=0.0).to(tl.float32)
    if FMT == 1 or FMT == 3:  # Q4_1, Q5_1: d, m
        return d, tl.load(dm_ptr + r * s_dm + (cc // 32)[None], mask=ok, other=0.0).to(tl.float32)
    return d, tl.zeros_like(d)


@triton.jit
def _high_bits(q_lo, q_hi, c_lo, c_hi, cc_lo, r, ok, ok_chunks, qh_ptr, s_qh, FMT: tl.constexpr):
    """The codes' bits above 4 added (a nibble pair's two columns share their high byte or word)."""
    if FMT == 2 or FMT == 3:  # Q5_0, Q5_1: a word per 32 columns, bit c % 32
        word = tl.load(qh_ptr + r * s_qh + (cc_lo // 32)[None], mask=ok_chunks, other=0)  # [BN, C, 1]
        q_lo = q_lo | (((word >> (c_lo % 32)[None]) & 1) << 4)
        q_hi = q_hi | (((word >> (c_hi % 32)[None]) & 1) << 4)
    if FMT == 6:  # Q5_K: bit (c % 256) // 32 of byte 32 (c // 256) + c % 32
        byte = tl.load(qh_ptr + r * s_qh + ((c_lo // 256) * 32 + c_lo % 32)[None], mask=ok, other=0).to(tl.int32)
        q_lo = q_lo | (((byte >> ((c_lo % 256) // 32)[None]) & 1) << 4)
        q_hi = q_hi | (((byte >> ((c_hi % 256) // 32)[None]) & 1) << 4)
    if FMT == 7:  # Q6_K: 2 bits at 2 ((c % 128) // 32) of byte 64 (c // 256) + 32 ((c % 256) // 128) + c % 32
        at = (c_lo // 256) * 64 + 32 * ((c_lo % 256) // 128) + c_lo % 32
        byte = tl.load(qh_ptr + r * s_qh + at[None], mask=ok, other=0).to(tl.int32)
        q_lo = q_lo | (((byte >> (2 * ((c_lo % 128) // 32))[None]) & 3) << 4)
        q_hi = q_hi | (((byte >> (2 * ((c_hi % 128) // 32))[None]) & 3) << 4)
    return q_lo, q_hi


@triton.jit
def codes(qs_ptr, qh_ptr, rows, n_ok, k0, K, s_qs, s_qh, FMT: tl.constexpr, RUN: tl.constexpr, BH: tl.constexpr):
    """The integer codes of columns k0 .. k0 + 2 BH of rows `rows` [BN], as two halves in 16-column chunks (each
    chunk 16 consecutive columns within one group of factors): (q_lo, q_hi [BN, BH / 16, 16] int32, their
    columns c_lo, c_hi [BH / 16, 16], each chunk's first column cc_lo, cc_hi [BH / 16, 1], the masks of the codes'
    factors ok_chunks_lo, ok_chunks_hi, the rows as r [BN, 1, 1] int64). A nibble format's halves are the low and
    high nibbles of BH bytes (k0 a multiple of 2 RUN); Q8_0's, the first and second BH columns."""
    first = 16 * tl.arange(0, BH // 16)[:, None]  # each chunk's first byte (Q8_0: column) in the tile, [C, 1]
    at = first + tl.arange(0, 16)[None, :]  # [C, 16]
    r = rows[:, None, None].to(tl.int64)
    rows_ok = n_ok[:, None, None]
    if FMT == 4:
        c_lo = k0 + at
        cc_lo = k0 + first
        c_hi = c_lo + BH
        cc_hi = cc_lo + BH
        ok_lo = rows_ok & (c_lo < K)[None]
        ok_hi = rows_ok & (c_hi < K)[None]
        q_lo = tl.load(qs_ptr + r * s_qs + c_lo[None], mask=ok_lo, other=0).to(tl.int32)
        q_hi = tl.load(qs_ptr + r * s_qs + c_hi[None], mask=ok_hi, other=0).to(tl.int32)
    else:
        byte = k0 // 2 + at
        c_lo = (byte // RUN) * (2 * RUN) + byte % RUN
        chunk = k0 // 2 + first
        cc_lo = (chunk // RUN) * (2 * RUN) + chunk % RUN
        c_hi = c_lo + RUN
        cc_hi = cc_lo + RUN
        ok_lo = rows_ok & (c_lo < K)[None]  # K is whole runs of 2 RUN columns: c_hi < K with c_lo
        ok_hi = ok_lo
        packed = tl.load(qs_ptr + r * s_qs + byte[None], mask=ok_lo, other=0).to(tl.int32)
        q_lo = packed & 15
        q_hi = (packed >> 4) & 15
    ok_chunks_lo = rows_ok & (cc_lo < K)[None]
    ok_chunks_hi = rows_ok & (cc_hi < K)[None]
    q_lo, q_hi = _high_bits(q_lo, q_hi, c_lo, c_hi, cc_lo, r, ok_lo, ok_chunks_lo, qh_ptr, s_qh, FMT)
    return q_lo, q_hi, c_lo, c_hi, cc_lo, cc_hi, ok_chunks_lo, ok_chunks_hi, r


@triton.jit
def code_zero(FMT: tl.constexpr):
    """The code a format's weights are centred on: a weight is scale (q - zero) + offset."""
    return 8 if FMT == 0 else 16 if FMT == 2 else 32 if FMT == 7 else 0


@triton.jit
def tile(qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, rows, n_ok, k0, K, s_qs, s_qh, s_sc, s_mn, s_d, s_dm,
         FMT: tl.constexpr, RUN: tl.constexpr, BH: tl.constexpr):
    """`codes`' columns dequantized: (w_lo, w_hi [BN, BH / 16, 16] fp32, their columns c_lo, c_hi)."""
    q_lo, q_hi, c_lo, c_hi, cc_lo, cc_hi, ok_chunks_lo, ok_chunks_hi, r = codes(
        qs_ptr, qh_ptr, rows, n_ok, k0, K, s_qs, s_qh, FMT, RUN, BH)
    zero = code_zero(FMT)
    scale, offset = factors(cc_lo, r, ok_chunks_lo, d_ptr, dm_ptr, sc_ptr, mn_ptr, s_d, s_dm, s_sc, s_mn, FMT)
    w_lo = scale * (q_lo - zero).to(tl.float32) + offset
    scale, offset = factors(cc_hi, r, ok_chunks_hi, d_ptr, dm_ptr, sc_ptr, mn_ptr, s_d, s_dm, s_sc, s_mn, FMT)
    w_hi = scale * (q_hi - zero).to(tl.float32) + offset
    return w_lo, w_hi, c_lo, c_hi


@triton.jit
def dot_step(acc, x_rows, m_ok, w_lo, w_hi, c_lo, c_hi, K, BN: tl.constexpr, BH: tl.constexpr,
              PRECISION: tl.constexpr):
    """acc [BM, BN] += the activation rows x_rows [BM, 1] (m_ok: live) times a tile's two halves, on tensor cores:
    the weights rounded to the activations' dtype."""
    c_lo, c_hi = tl.reshape(c_lo, (BH,)), tl.reshape(c_hi, (BH,))
    x_lo = tl.load(x_rows + c_lo[None, :], mask=m_ok[:, None] & (c_lo < K)[None, :], other=0.0)
    x_hi = tl.load(x_rows + c_hi[None, :], mask=m_ok[:, None] & (c_hi < K)[None, :], other=0.0)
    w_lo, w_hi = tl.reshape(w_lo, (BN, BH)).to(x_lo.dtype), tl.reshape(w_hi, (BN, BH)).to(x_lo.dtype)
    acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
    return tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)


@triton.jit
def store_gemv(out, m, m_ok, rows, n_ok, split, M, N, bias_ptr, out_ptr, part_ptr, s_out, HAS_BIAS: tl.constexpr,
               DIRECT: tl.constexpr):
    """A gemv program's sums out [BM, BN] (rows m of the activations, `rows` of the weights): DIRECT (one split)
    with the bias, in out's dtype; else fp32 partial sums at the split's place for the reduce."""
    ok = m_ok[:, None] & n_ok[None, :]
    if DIRECT:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * s_out + rows[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (split * M + m[:, None]).to(tl.int64) * N + rows[None, :], out, mask=ok)
