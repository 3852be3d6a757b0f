"""Quantized weight formats: fitting int8 / int4 codes to float weights, and where int4 codes sit in memory.

    quantize_int8            per-output-row symmetric int8: w[n, k] = q[n, k] * scale[n]
    group_affine_from_float  per-(row, 32-column group) int4: w = q * scale + offset, q in 0..15 (GroupAffine)
    pack_int4                a GroupAffine in one of two int4 layouts (Int4Layout): torch's int4pack, for
                             aten._weight_int4pack_mm_for_cpu, or the native kernel's (kernels/cpu/quant_gemv.py)

Legend: N = out features (rows of W), K = in features, G = K / 32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagellm.kernels.cpu import quant_gemv

GROUP_SIZE = quant_gemv.GROUP_SIZE  # columns per int4 group
KERNEL_DTYPE = torch.bfloat16  # scales are stored in the kernels' dtype
_CHUNK_ROWS = 1024  # rows quantized / packed at a time at load: temporaries stay small and in cache


@dataclass(frozen=True)
class GroupAffine:
    """int4 codes with one scale and offset per (row, 32-column group): w = q * scale + offset.

    The exact form of GGUF's 4-bit formats (Q4_K: d*sc*q - dmin*m per 32 weights), so those reach Int4Linear
    without a lossy float round trip.
    """

    q: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, G] float32
    offset: torch.Tensor  # [N, G] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.q.shape
        w = self.q.view(rows, -1, GROUP_SIZE).float() * self.scale[..., None] + self.offset[..., None]
        return w.view(rows, cols)

    def map_rows(self, fn) -> GroupAffine:
        """The same weights with rows rearranged by `fn` (applied to codes, scales and offsets alike)."""
        return GroupAffine(fn(self.q), fn(self.scale), fn(self.offset))


def can_quantize(scheme: str, out_features: int, in_features: int) -> bool:
    """Kernel limits: the int8 kernel walks K 16 at a time with no tail; int4 packs N in blocks of 16."""
    return in_features % GROUP_SIZE == 0 and (scheme != "int4" or out_features % 16 == 0)


def group_affine_from_float(weight: torch.Tensor) -> GroupAffine:
    """Asymmetric int4 per 32-column group, least-squares fitted (see _fit_groups); the final codes are chosen
    against the bf16-rounded scale and zero the kernel uses, so weights of the form (q - 8) * s + z with s, z
    in bf16 round-trip exactly."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.uint8)
    scale = torch.empty(rows, cols // GROUP_SIZE)
    offset = torch.empty_like(scale)
    for start in range(0, rows, _CHUNK_ROWS):
        w = weight[start:start + _CHUNK_ROWS].float().view(-1, cols // GROUP_SIZE, GROUP_SIZE)
        s, m = _fit_groups(w)
        s = s.to(KERNEL_DTYPE).float()
        z = m + 8 * s
        z = torch.where(z.abs() <= 1e-6 * (m.abs() + 8 * s.abs()), 0.0, z)  # fit noise around an exact 0
        z = z.to(KERNEL_DTYPE).float()
        inv = torch.where(s != 0, 1 / s, 0.0)  # codes are integers +- 1e-7 when w is exactly representable
        codes = torch.addcmul((8 - z * inv)[..., None], w, inv[..., None])  # (w - z) / s + 8
        q[start:start + _CHUNK_ROWS] = codes.round_().clamp_(0, 15).view(-1, cols)
        scale[start:start + _CHUNK_ROWS], offset[start:start + _CHUNK_ROWS] = s, z - 8 * s
    return GroupAffine(q, scale, offset)


def _fit_groups(w: torch.Tensor, shrinks=(1.0, 0.9, 0.8), rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) per group of w [rows, G, 32] minimising sum (q * scale + min - w)^2, q = codes 0..15.

    From the min/max grid and two narrower ones (shrunk around the centre: outliers clip), alternate: codes for
    the grid, then the least-squares scale and min for those codes; keep the best grid per group: closer to the
    dense model than min/max alone, for a slower int4 load.
    measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
    """
    n = float(w.shape[-1])
    lo, hi = w.aminmax(dim=-1)
    sum_w, sum_ww = w.sum(-1), torch.linalg.vecdot(w, w)
    best = (torch.full_like(lo, float("inf")), (hi - lo) / 15, lo)
    for shrink in shrinks:
        scale, low = (hi - lo) * shrink / 15, lo + (hi - lo) * (1 - shrink) / 2
        for _ in range(rounds):
            inv = torch.where(scale > 0, 1 / scale, 0.0)
            q = torch.addcmul((-low * inv)[..., None], w, inv[..., None]).round_().clamp_(0, 15)
            sum_q, sum_qq, sum_qw = q.sum(-1), torch.linalg.vecdot(q, q), torch.linalg.vecdot(q, w)
            det = n * sum_qq - sum_q * sum_q
            ok = det > 0  # else every code equal: keep the grid
            det = torch.where(ok, det, 1.0)
            scale = torch.where(ok, (n * sum_qw - sum_q * sum_w) / det, scale)
            low = torch.where(ok, (sum_qq * sum_w - sum_q * sum_qw) / det, low)
            err = (scale * scale * sum_qq + 2 * scale * low * sum_q + n * low * low
                   - 2 * scale * sum_qw - 2 * low * sum_w + sum_ww)  # sum (q * scale + low - w)^2, expanded
            better = err < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((err, scale, low), best))
    return best[1], best[2]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: scale = max|w| / 127 in bf16, q = round(w / scale) clamped to +-127."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, dtype=KERNEL_DTYPE)
    for start in range(0, rows, _CHUNK_ROWS):
        w = weight[start:start + _CHUNK_ROWS].float()
        lo, hi = w.aminmax(dim=1)
        s = (torch.maximum(hi, -lo) / 127).to(KERNEL_DTYPE)
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start:start + _CHUNK_ROWS] = (w * (1 / s.float())[:, None]).round_().clamp_(-127, 127)
        scale[start:start + _CHUNK_ROWS] = s
    return q, scale


@dataclass(frozen=True)
class Int4Layout:
    """How [N, K] int4 codes sit in their [N, K/2] bytes, and the scales beside them.

    native: the native kernel's layout (kernels/cpu/quant_gemv.py): blocks of 16 rows, scales and zeros
    [N/16, G, 2, 16] bf16.

    Otherwise aten._convert_weight_to_int4pack_for_cpu's, with scales and zeros [G, N, 2] bf16: rows go in
    blocks of `block_n`, each stored k-major as [K, block_n / 2] bytes; in a full block the low nibbles hold
    the first half of the rows and the high nibbles the second half (`halves`, the AVX2/AVX512 kernels) or
    even/odd row pairs (the scalar kernel); a last, partial block always holds pairs. That layout is
    undocumented and depends on the CPU capability, so `detect_int4_layout` checks it.
    """

    block_n: int
    halves: bool
    native: bool = False


NATIVE_INT4 = Int4Layout(quant_gemv.BLOCK_ROWS, halves=False, native=True)
_LAYOUT_CANDIDATES = (Int4Layout(64, True), Int4Layout(32, True), Int4Layout(32, False), Int4Layout(64, False))


@functools.cache
def detect_int4_layout() -> Int4Layout:
    """Pack a probe with full and partial blocks for every candidate block size; keep the layout that reads back."""
    probe = torch.randint(0, 16, (2 * 64 + 48, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2)
    ids = torch.arange(probe.shape[0])
    for layout in _LAYOUT_CANDIDATES:
        if torch.equal(int4_row_codes(packed, layout, ids), probe.to(torch.uint8)):
            return layout
    raise RuntimeError("this torch build packs int4 weights in a layout pagellm cannot read; use int8")


def int4_row_codes(packed: torch.Tensor, layout: Int4Layout, ids: torch.Tensor) -> torch.Tensor:
    """The codes [len(ids), K] of rows `ids` of a packed [N, K/2] weight, read straight from its bytes."""
    if layout.native:
        return quant_gemv.int4_codes(packed, ids)
    rows, half_k = packed.shape
    block, ids = layout.block_n, ids.reshape(-1).long()
    full_end = rows // block * block
    in_tail = ids >= full_end
    j = ids % block
    width = torch.where(in_tail, rows - full_end, block)  # rows of the id's block
    if layout.halves:
        byte = torch.where(in_tail, j // 2, j % (block // 2))
        shift = torch.where(in_tail, j % 2, j // (block // 2)) * 4
    else:
        byte, shift = j // 2, (j % 2) * 4
    base = (ids - j) * half_k + byte  # block start (rows before it times K/2 bytes) + byte in a k-row
    k = torch.arange(2 * half_k, device=packed.device)
    addresses = base[:, None] + k[None, :] * (width // 2)[:, None]
    return (packed.reshape(-1)[addresses] >> shift[:, None].to(torch.uint8)) & 15


def unpack_tile(packed: torch.Tensor, layout: Int4Layout, start: int, stop: int, out: torch.Tensor) -> None:
    """Codes of rows [start, stop) (start on a block boundary) into out [K, stop - start], transposed."""
    rows, half_k = packed.shape
    block = layout.block_n
    full_stop = min(stop, rows // block * block)
    if full_stop > start:
        nb = (full_stop - start) // block
        src = packed[start:full_stop].view(nb, 2 * half_k, block // 2)  # [blocks, K, block/2]
        dst = out[:, : full_stop - start].view(2 * half_k, nb, block).transpose(0, 1)  # [blocks, K, block]
        low, high = (dst[..., : block // 2], dst[..., block // 2:]) if layout.halves else (dst[..., 0::2], dst[..., 1::2])
        torch.bitwise_and(src, 15, out=low)
        torch.bitwise_right_shift(src, 4, out=high)
    if stop > full_stop:  # the partial last block: row pairs
        src = packed[full_stop:stop].view(2 * half_k, (stop - full_stop) // 2)
        dst = out[:, full_stop - start: stop - start]
        torch.bitwise_and(src, 15, out=dst[:, 0::2])
        torch.bitwise_right_shift(src, 4, out=dst[:, 1::2])


def int4_scale_zero(scales_and_zeros: torch.Tensor, layout: Int4Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each [N, G] float32: w = (q - 8) * scale + zero."""
    if layout.native:
        return quant_gemv.int4_scale_zero(scales_and_zeros)
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    return sz[..., 0], sz[..., 1]


def pack_int4(weights: GroupAffine, native: bool) -> tuple[torch.Tensor, torch.Tensor, Int4Layout]:
    """(packed [N, K/2] uint8, scales and zeros in bf16, layout): the native kernel's layout or torch's."""
    rows, cols = weights.shape
    scale = weights.scale
    zero = weights.offset + 8 * scale  # both kernels compute (q - 8) * scale + zero
    if native:
        return *quant_gemv.pack_int4(weights.q, scale, zero), NATIVE_INT4
    scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
    layout = detect_int4_layout()
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    for start in range(0, rows, _CHUNK_ROWS):  # blocks never straddle a chunk: _CHUNK_ROWS % 64 == 0
        codes = weights.q[start:start + _CHUNK_ROWS].to(torch.int32)
        packed[start:start + _CHUNK_ROWS] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    return packed, scales_and_zeros, layout
