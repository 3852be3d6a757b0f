"""Matmuls on GGUF weights kept in planes on a GPU (kernels/reference/gguf_planes.py), in Triton.

Three kernels, chosen by the number of rows M of the activations (`Crossovers`, per format):
    gemv   small M (decode): each program dequantizes BN weight rows in registers, a K slice at a time, and sums
           against every activation row; split over K where the rows alone would leave the GPU idle (partial sums
           in fp32, then one reduce). Bound by the bytes of the weights: 4.5 bits where bf16 reads 16.
    dot    middle M: tiles of weights dequantized to the activations' dtype feed tensor cores (tl.dot).
    dense  large M (prefill): the segment dequantized into a scratch weight of the activations' dtype, then one
           cuBLAS GEMM; at large M the dequantization is paid once for many rows.
Activations stay in their dtype (bf16 on a GPU), or the gemv's go to int8 per 32 columns (int8_activations:
kernels/gpu/gguf_gemv_q8.py); sums are fp32. Every launch grid follows from shapes alone, so a
decode step that calls these can be captured as a CUDA graph.

Import only where Triton kernels are wanted (kernels/gpu/layer_ops.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagellm.kernels.gpu.gguf_gemv_q8 import launch_gemv_q8, quantize_rows
from pagellm.kernels.gpu.gguf_tiles import dot_step, store_gemv, tile
from pagellm.kernels.reference.gguf_planes import FORMATS, RUNS, GGUFPlanes, T

@triton.jit
def _gemv_kernel(x_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, bias_ptr, out_ptr, part_ptr,
                 M, N, K, k_per_split, s_x, s_qs, s_qh, s_sc, s_mn, s_d, s_dm, s_out,
                 HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, FMT: tl.constexpr, RUN: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr):
    """out[m, n] (DIRECT: one split, bias added, in out's dtype) or the split's fp32 partial sums. Products add up
    elementwise across the K loop and are summed once at its end (a sum per step costs warp shuffles)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    n_ok = rows < N
    m = tl.arange(0, BM)
    m_ok = m < M
    x_rows = x_ptr + m[:, None, None, None].to(tl.int64) * s_x  # [BM, 1, 1, 1]
    x_ok = m_ok[:, None, None, None]
    acc = tl.zeros([BM, BN, BH // 16, 16], dtype=tl.float32)
    start = split * k_per_split
    for k0 in range(start, tl.minimum(start + k_per_split, K), 2 * BH):
        w_lo, w_hi, c_lo, c_hi = tile(qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, rows, n_ok, k0, K,
                                       s_qs, s_qh, s_sc, s_mn, s_d, s_dm, FMT, RUN, BH)
        x_lo = tl.load(x_rows + c_lo[None, None], mask=x_ok & (c_lo < K)[None, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_rows + c_hi[None, None], mask=x_ok & (c_hi < K)[None, None], other=0.0).to(tl.float32)
        acc += w_lo[None] * x_lo + w_hi[None] * x_hi  # [BM, BN, C, 16]
    out = tl.sum(tl.sum(acc, axis=3), axis=2)  # [BM, BN]
    store_gemv(out, m, m_ok, rows, n_ok, split, M, N, bias_ptr, out_ptr, part_ptr, s_out, HAS_BIAS, DIRECT)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, s_out, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[m, :] = sum of the splits' partial sums (+ bias), in out's dtype."""
    m, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(SPLITS):
        acc += tl.load(part_ptr + (split * M + m).to(tl.int64) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * s_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dot_kernel(x_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, bias_ptr, out_ptr, M, N, K,
                s_x, s_qs, s_qh, s_sc, s_mn, s_d, s_dm, s_out, HAS_BIAS: tl.constexpr, FMT: tl.constexpr,
                RUN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr,
                PRECISION: tl.constexpr):
    """out [BM, BN] tiles: weight tiles dequantized to the activations' dtype, multiplied on tensor cores."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    m_ok = m < M
    rows = pid_n * BN + tl.arange(0, BN)
    n_ok = rows < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * s_x
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, 2 * BH):
        w_lo, w_hi, c_lo, c_hi = tile(qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, rows, n_ok, k0, K,
                                       s_qs, s_qh, s_sc, s_mn, s_d, s_dm, FMT, RUN, BH)
        acc = dot_step(acc, x_rows, m_ok, w_lo, w_hi, c_lo, c_hi, K, BN, BH, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * s_out + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, ids_ptr, out_ptr, R, K,
                    s_qs, s_qh, s_sc, s_mn, s_d, s_dm, s_out, HAS_IDS: tl.constexpr, FMT: tl.constexpr,
                    RUN: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr):
    """out[i, :] = the weights of row ids[i] (or row i), in out's dtype: 2 BH columns a program."""
    i = tl.program_id(0) * BN + tl.arange(0, BN)
    i_ok = i < R
    if HAS_IDS:
        rows = tl.load(ids_ptr + i, mask=i_ok, other=0)
    else:
        rows = i
    w_lo, w_hi, c_lo, c_hi = tile(qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, rows, i_ok, tl.program_id(1) * 2 * BH,
                                   K, s_qs, s_qh, s_sc, s_mn, s_d, s_dm, FMT, RUN, BH)
    out_rows = out_ptr + i[:, None, None].to(tl.int64) * s_out
    dtype = out_ptr.dtype.element_ty
    tl.store(out_rows + c_lo[None], w_lo.to(dtype), mask=i_ok[:, None, None] & (c_lo < K)[None])
    tl.store(out_rows + c_hi[None], w_hi.to(dtype), mask=i_ok[:, None, None] & (c_hi < K)[None])


@dataclass(frozen=True)
class Crossovers:
    """The largest M each kernel takes (above `dot_max`: dequantized, then cuBLAS)."""

    gemv_max: int = 8
    dot_max: int = 256


# per format; the defaults follow llama.cpp's CUDA choice (its vector kernel up to 8 rows) until a device run
# measures ours (pagellm bench device-check --gguf prints the measured crossovers)
CROSSOVERS: dict[T, Crossovers] = {t: Crossovers() for t in FORMATS}
GEMV_TILES = {1: (1, 16, 128), 2: (2, 16, 128), 4: (4, 16, 64), 8: (8, 16, 32)}  # BM -> (BM, BN, BH)
DOT_TILE = (32, 64, 64)  # BM, BN, BH
DEQUANT_TILE = (16, 128)  # BN, BH
REDUCE_BLOCK = 256


def describe_crossovers() -> str:
    """The kernel each M takes, per format, in one line (logged once, when a GGUF loads on a GPU)."""
    groups: dict[Crossovers, list[str]] = {}
    for kind, crossovers in CROSSOVERS.items():
        groups.setdefault(crossovers, []).append(kind.name)
    return "; ".join(f"{'/'.join(names)}: gemv to M={c.gemv_max}, tiles to {c.dot_max}, then dequantized + cuBLAS"
                     for c, names in groups.items())


def _strides(planes: GGUFPlanes) -> tuple[int, ...]:
    return tuple(t.stride(0) if t.dim() == 2 else 0 for t in planes.tensors())


def _gemv_block_m(m: int) -> int:
    return next(bm for bm in GEMV_TILES if bm >= m)


class BoundPlanesMatmul:
    """y = x W^T + b for W one or more segments side by side (each one format's planes), bound once: the kernel
    each M takes, and how far each segment's K is split, follow from shapes alone (graph capture)."""

    def __init__(self, segments: list[GGUFPlanes], bias: torch.Tensor | None, target_programs: int | None = None,
                 int8_activations: bool = False):
        """int8_activations: the gemv quantizes the activations to int8 per 32 columns (kernels/gpu/gguf_gemv_q8.py;
        off until a device measures it faster than bf16)."""
        self.segments, self.bias, self.int8_activations = segments, bias, int8_activations
        self.in_features = segments[0].cols
        self.out_features = sum(s.rows for s in segments)
        device = segments[0].qs.device
        if target_programs is None:  # two waves of the GPU's SMs; a few programs under the interpreter
            target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 4
        self.target_programs = target_programs
        self.offsets = [sum(s.rows for s in segments[:i]) for i in range(len(segments))]

    def splits(self, segment: GGUFPlanes, block_m: int) -> tuple[int, int]:
        """(splits, columns per split) of the gemv over `segment`: enough programs to fill the GPU."""
        _, bn, bh = GEMV_TILES[block_m]
        steps = triton.cdiv(segment.cols, 2 * bh)
        wanted = max(1, min(steps, self.target_programs // triton.cdiv(segment.rows, bn)))
        per_split = triton.cdiv(steps, wanted)
        return triton.cdiv(steps, per_split), per_split * 2 * bh

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty((m, self.out_features), dtype=out_dtype or x.dtype, device=x.device)
        if m:
            crossovers = CROSSOVERS[self.segments[0].ggml_type]  # a joined layer: its first segment's
            if m > crossovers.dot_max:
                self._dense(rows, out)
            else:
                # the activations quantized once for every segment (a fused q/k/v's, gate/up's)
                quantized = quantize_rows(rows) if self.int8_activations and m <= crossovers.gemv_max else None
                for segment, offset in zip(self.segments, self.offsets):
                    bias = None if self.bias is None else self.bias[offset:offset + segment.rows]
                    target = out[:, offset:offset + segment.rows]
                    if m <= crossovers.gemv_max:
                        self._gemv(rows, segment, bias, target, quantized)
                    else:
                        self._dot(rows, segment, bias, target)
        return out.view(*x.shape[:-1], self.out_features)

    def _gemv(self, x: torch.Tensor, w: GGUFPlanes, bias: torch.Tensor | None, out: torch.Tensor,
              quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """quantized: x's int8 codes and scales (gguf_gemv_q8.quantize_rows), multiplied in integers instead."""
        m, n = x.shape[0], w.rows
        bm, bn, bh = GEMV_TILES[_gemv_block_m(m)]
        splits, per_split = self.splits(w, bm)
        direct = splits == 1
        part = out if direct else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        if quantized is not None:
            launch_gemv_q8(quantized, w, bias, out, part, (bm, bn, bh), splits, per_split, _strides(w))
        else:
            _gemv_kernel[(triton.cdiv(n, bn), splits)](
                x, *w.tensors(), out if bias is None else bias, out, part, m, n, w.cols, per_split, x.stride(0),
                *_strides(w), out.stride(0), HAS_BIAS=bias is not None, DIRECT=direct,
                FMT=FORMATS.index(w.ggml_type), RUN=RUNS[w.ggml_type], BM=bm, BN=bn, BH=bh)
        if not direct:
            _reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
                part, out if bias is None else bias, out, m, n, out.stride(0), SPLITS=splits,
                HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK)

    def _dot(self, x: torch.Tensor, w: GGUFPlanes, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        bm, bn, bh = DOT_TILE
        m, n = x.shape[0], w.rows
        _dot_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, *w.tensors(), out if bias is None else bias, out, m, n, w.cols, x.stride(0), *_strides(w),
            out.stride(0), HAS_BIAS=bias is not None, FMT=FORMATS.index(w.ggml_type), RUN=RUNS[w.ggml_type],
            BM=bm, BN=bn, BH=bh, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")

    def _dense(self, x: torch.Tensor, out: torch.Tensor) -> None:
        weight = torch.empty((self.out_features, self.in_features), dtype=x.dtype, device=x.device)
        for segment, offset in zip(self.segments, self.offsets):
            dequantize_into(segment, weight[offset:offset + segment.rows])
        out.copy_(F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype)))


def dequantize_into(w: GGUFPlanes, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """out [R, K] = the weights of rows `ids` [R] (all rows where None), in out's dtype."""
    bn, bh = DEQUANT_TILE
    count = w.rows if ids is None else ids.numel()
    if count:
        _dequant_kernel[(triton.cdiv(count, bn), triton.cdiv(w.cols, 2 * bh))](
            *w.tensors(), out if ids is None else ids, out, count, w.cols, *_strides(w), out.stride(0),
            HAS_IDS=ids is not None, FMT=FORMATS.index(w.ggml_type), RUN=RUNS[w.ggml_type], BN=bn, BH=bh)
    return out


def rows(w: GGUFPlanes, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized rows `ids` [T] -> [T, K] in `dtype` (a token table's lookup)."""
    flat = ids.reshape(-1)
    return dequantize_into(w, torch.empty((flat.numel(), w.cols), dtype=dtype, device=ids.device), flat)
