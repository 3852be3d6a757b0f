"""GGUF tensors from their file's blocks to the kernels' layout, at load (kernels/cpu/gguf_blocks.py computes on it).

Each format is, per row and 32-column group, integer codes and fp32 factors: w = scale * (q - zero) (+ min).
`repack` reads a tensor's raw blocks and lays those same codes and factors out for the kernel (the layout:
csrc/gguf_format.h): 16 rows per block, the low nibbles as pagellm's int4 layout, code bits above 4 as bit
planes (Q6_K's two as quads of chunks), scales per group and, for K formats, per 256 columns. Nothing is
re-rounded, and the bytes stay within 3% of the file's (Q4_K: 148 per 144; the unpacked 6-bit scales cost the
rest).

Blocks as the file stores them (sizes in bytes; codes of a block in column order unless said):
    Q4_0  32: d f16 | 16 nibble bytes (low nibbles columns 0-15, high 16-31)       w = d (q - 8)
    Q4_1  32: d, m f16 | 16 nibble bytes                                           w = d q + m
    Q5_0  32: d f16 | qh u32 (bit k: column k's 5th bit) | 16 nibble bytes         w = d (q - 16)
    Q5_1  32: d, m f16 | qh u32 | 16 nibble bytes                                  w = d q + m
    Q8_0  32: d f16 | 32 int8                                                      w = d q
    Q4_K  256: d, dmin f16 | 12 bytes of eight 6-bit (sc, m) | 128 nibble bytes in runs of 32 (run i: low
          nibbles sub-block 2i, high 2i + 1)                                     w = d sc q - dmin m per 32
    Q5_K  256: as Q4_K, with qh[32] before the nibbles (bit s of qh[l]: sub-block s, column l's 5th bit)
    Q6_K  256: ql[128] | qh[64] | int8 sc[16] | d f16; column 128h + 32j + l: low nibble of ql[64h + l + 32(j % 2)]
          (high nibble for j >= 2), top 2 bits (qh[32h + l] >> 2j) & 3          w = d sc (q - 32) per 16
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagellm.kernels.build import native
from pagellm.kernels.cpu import gguf_layout
from pagellm.kernels.cpu.gguf_blocks import BLOCK_ROWS, FORMAT_IDS, GROUP_SIZE, GGUFWeight, T

_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}
_SUPER = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})  # 256-column blocks with per-block factors
_CHUNK_ROWS = 1024  # rows repacked at a time: temporaries stay small


def supports(ggml_type: T, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] tensor of this type can stay in its blocks: a kernel format, whole 16-row blocks."""
    return ggml_type in FORMAT_IDS and rows % BLOCK_ROWS == 0 and cols % GROUP_SIZE == 0


def repack(data: np.ndarray, ggml_type: T, shape: tuple[int, int],
           consumed: Callable[[int, int], None] | None = None, level: str | None = native.DEFAULT_LEVEL) -> GGUFWeight:
    """The GGUFWeight of a [rows, cols] tensor from its raw block bytes (`data`, as the file stores them).
    consumed(first_row, end_row) is called once those rows of `data` are read and will not be read again.
    level: the native kernels' level that lays the codes out (csrc/gguf_layout.cpp; None: numpy). The bytes are
    the same at every level and in numpy; the default is the process's level."""
    level = native.default_level() if level == native.DEFAULT_LEVEL else level
    rows, cols = shape
    if not supports(ggml_type, rows, cols):
        raise ValueError(f"a {ggml_type.name} tensor of shape {shape} cannot be kept in its blocks "
                         f"(formats {sorted(t.name for t in FORMAT_IDS)}, rows a multiple of {BLOCK_ROWS})")
    by_row = np.asarray(data).reshape(rows, -1)
    out = None  # filled chunk by chunk: a big tensor (a 128k-row vocab head) is never held twice
    for start in range(0, rows, _CHUNK_ROWS):
        parts = _repack_rows(by_row[start:start + _CHUNK_ROWS], ggml_type, cols, level)
        if out is None:
            out = [np.empty((rows // BLOCK_ROWS, *p.shape[1:]), np.uint8) for p in parts]
        for whole, part in zip(out, parts):
            whole[start // BLOCK_ROWS:start // BLOCK_ROWS + part.shape[0]] = part
        if consumed is not None:
            consumed(start, min(start + _CHUNK_ROWS, rows))
    qs, gp, sp = (torch.from_numpy(t) for t in out)
    return GGUFWeight(ggml_type, rows, cols, qs, gp, sp)


def _repack_rows(by_row: np.ndarray, ggml_type: T, cols: int,
                 level: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = by_row.shape[0]
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    codes, group_factors, super_factors = _DECODERS[ggml_type](by_row.reshape(-1, type_size), level)
    codes = codes.reshape(n, cols)
    bits = _BITS[ggml_type]
    qs = gguf_layout.code_bytes(codes, bits, level)
    qs = _code_bytes(codes, bits) if qs is None else qs
    gp = _by_block(group_factors.reshape(n, cols // GROUP_SIZE, -1))
    sp = (_by_block(super_factors.reshape(n, cols // 256, -1)) if ggml_type in _SUPER
          else np.zeros((n // BLOCK_ROWS, 0, 0), np.uint8))
    return qs, gp, sp


def _by_block(factors: np.ndarray) -> np.ndarray:
    """[n, groups, S] factors -> [n/16, groups, S * 16 * itemsize] bytes: per group, S runs of the 16 rows'."""
    n, groups, kinds = factors.shape
    blocked = factors.reshape(n // BLOCK_ROWS, BLOCK_ROWS, groups, kinds).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(blocked).view(np.uint8).reshape(n // BLOCK_ROWS, groups, -1)


def _code_bytes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[n, K] codes -> [n/16, G, group bytes] as gguf_format.h lays them out: the reference of csrc/gguf_layout.cpp,
    and where it does not build."""
    n, cols = codes.shape
    per_chunk = codes.reshape(n // BLOCK_ROWS, BLOCK_ROWS, cols // GROUP_SIZE, 8, 4)  # [nb, r, g, t, b]
    if bits == 8:
        return np.ascontiguousarray(per_chunk.transpose(0, 2, 3, 1, 4)).view(np.uint8).reshape(
            n // BLOCK_ROWS, cols // GROUP_SIZE, 512)
    low = (per_chunk & 15).astype(np.uint8).reshape(*per_chunk.shape[:4], 2, 2)  # [.., t, high?, b']
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)  # [nb, g, t, r, b']
    parts = [nibbles.reshape(n // BLOCK_ROWS, cols // GROUP_SIZE, 256)]
    if bits == 6:  # two high bits as quads: chunk 4j + c's at bits 8b + 2c, 8b + 2c + 1 of quad j
        high = ((per_chunk >> 4) & 3).astype(np.uint32).reshape(*per_chunk.shape[:3], 2, 4, 4)  # [.., j, c, b]
        quads = (high << (8 * np.arange(4) + 2 * np.arange(4)[:, None]).astype(np.uint32)).sum(
            axis=(4, 5), dtype=np.uint32)  # [nb, r, g, j]
        parts.append(np.ascontiguousarray(quads.transpose(0, 2, 3, 1)).view(np.uint8).reshape(
            n // BLOCK_ROWS, cols // GROUP_SIZE, 128))  # [nb, g, j, r] uint32
        return np.concatenate(parts, axis=2)
    shifts = (8 * np.arange(4)[None, :] + np.arange(8)[:, None]).astype(np.uint32)  # [t, b]: bit 8b + t
    for bit in range(4, bits):
        plane = (((per_chunk.astype(np.uint32) >> bit) & 1) << shifts).sum(axis=(3, 4), dtype=np.uint32)  # [nb, r, g]
        parts.append(np.ascontiguousarray(plane.transpose(0, 2, 1)).view(np.uint8))  # [nb, g, 64]
    return np.concatenate(parts, axis=2)


# ---- the file's blocks -> (codes [blocks, 32 or 256], group factors, super factors) --------------------------


def _u16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.uint16)  # [blocks, 1] f16 bits


def _nibbles(code_bytes: np.ndarray, run: int, level: str | None = None) -> np.ndarray:
    """[blocks, bytes] -> [blocks, 2 * bytes]: each run of bytes gives its low nibbles, then its high (through
    csrc/gguf_layout.cpp at `level` where it runs)."""
    codes = gguf_layout.unpack_nibbles(code_bytes, run, level)
    if codes is not None:
        return codes
    runs = code_bytes.reshape(code_bytes.shape[0], -1, 1, run)
    return ((runs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(code_bytes.shape[0], -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian u32 -> [blocks, 32]: bit k << 4."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # [blocks, 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _legacy(blocks: np.ndarray, level: str | None, has_min: bool, has_fifth: bool):
    factors = [_u16(blocks, 0)] + ([_u16(blocks, 2)] if has_min else [])
    at = 4 if has_min else 2
    codes = _nibbles(blocks[:, at + (4 if has_fifth else 0):], 16, level)
    if has_fifth:
        codes = codes | _fifth_bits(blocks[:, at:at + 4])
    return codes, np.concatenate(factors, axis=1), None


def _q8_0(blocks: np.ndarray, level: str | None):
    return np.ascontiguousarray(blocks[:, 2:34]).view(np.int8), _u16(blocks, 0), None


def _k_quant(blocks: np.ndarray, level: str | None, has_fifth: bool):
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))  # [blocks, 8] each (Q5_K alike)
    codes = _nibbles(blocks[:, 48 if has_fifth else 16:], 32, level)  # [blocks, 256]
    if has_fifth:
        qh = blocks[:, 16:48]  # [blocks, 32]: bit s of byte l is sub-block s, column l
        codes = codes | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4).reshape(-1, 256)
    group = np.stack([sc.astype(np.uint8), m.astype(np.uint8)], axis=2)  # [blocks, 8, 2]
    return codes, group, np.concatenate([_u16(blocks, 0), _u16(blocks, 2)], axis=1)


def _q6_k(blocks: np.ndarray, level: str | None):
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [blocks, half, j % 2, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [blocks, half, 1, l]
    low = np.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)  # [b, h, j, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high << 4)).reshape(-1, 256)
    return codes, np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).reshape(-1, 8, 2), _u16(blocks, 208)


_DECODERS = {  # (the file's blocks, the level of the kernels that may help) -> codes, factors
    T.Q4_0: lambda b, level: _legacy(b, level, has_min=False, has_fifth=False),
    T.Q4_1: lambda b, level: _legacy(b, level, has_min=True, has_fifth=False),
    T.Q5_0: lambda b, level: _legacy(b, level, has_min=False, has_fifth=True),
    T.Q5_1: lambda b, level: _legacy(b, level, has_min=True, has_fifth=True),
    T.Q8_0: _q8_0,
    T.Q4_K: lambda b, level: _k_quant(b, level, has_fifth=False),
    T.Q5_K: lambda b, level: _k_quant(b, level, has_fifth=True),
    T.Q6_K: _q6_k,
}
