"""GGUF tensors bound for quantized layers, read without a whole float copy.

`LazyRows`: any 2-D tensor, dequantized only as row slices are read. The quantizers read 1024 rows at a time,
so a layer's float weights never exist whole (Gemma 3's fp32 embedding alone is 671 MB; peak RSS measured:
docs/benchmarks/2026-11-24-quantized-layer-crossovers.md).

`group_affine_of`: GGUF's 4-bit formats read as they are stored. Every one of these is exactly
`w = q * scale + offset` per 32-weight group, q in 0..15, which is what Int4Linear holds (group 32).
Dequantizing and requantizing with min/max would not reproduce it: a group's smallest and largest codes need
not be 0 and 15. So their blocks are unpacked directly:

    Q4_0  32 weights: d f16 | 16 code bytes                      w = d * (q - 8)
    Q4_1  32 weights: d f16 | m f16 | 16 code bytes              w = d * q + m
    Q4_K  256 weights: d f16 | dmin f16 | 12 bytes of eight 6-bit (sc, m) | 128 code bytes
                                                                 w = (d * sc) * q - dmin * m  per 32 weights

Codes: each run of R bytes holds 2R weights, the low nibbles first (R = 16 for Q4_0/Q4_1, 32 for Q4_K).
Scale and offset are computed in float32 in the gguf package's own order, so `GroupAffine.dequantize`
equals `gguf.quants.dequantize` bit for bit (tested).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagellm.layers.quantized import GROUP_SIZE, GroupAffine

T = gguf.GGMLQuantizationType
EXACT_INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})


class LazyRows:
    """A [N, K] GGUF tensor read as float32 row slices, dequantized on access: `rows[a:b]`, `rows.shape`."""

    def __init__(self, data: np.ndarray, ggml_type: T, shape: tuple[int, int]):
        self._data, self._type, self.shape = data.reshape(shape[0], -1), ggml_type, torch.Size(shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        values = gguf.quants.dequantize(self._data[rows], self._type)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only map
            values = values.copy()
        return torch.from_numpy(values).reshape(-1, self.shape[1])


def group_affine_of(data: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> GroupAffine:
    """The GroupAffine of a [N, K] tensor stored as Q4_0, Q4_1 or Q4_K (`data`: its raw block bytes)."""
    if ggml_type not in EXACT_INT4_TYPES:
        raise ValueError(f"{ggml_type.name} is not one of the exact int4 formats {sorted(t.name for t in EXACT_INT4_TYPES)}")
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = np.asarray(data).reshape(-1, type_size)
    if ggml_type == T.Q4_K:
        codes, scale, offset = _q4_k(blocks)
    else:
        d = _f16(blocks, 0)
        has_min = ggml_type == T.Q4_1
        codes = _codes(blocks[:, 4 if has_min else 2:], run=16)
        scale, offset = d, (_f16(blocks, 2) if has_min else -8 * d)  # -8d: q*d - 8d == (q - 8)*d exactly
    rows, cols = shape
    groups = cols // GROUP_SIZE
    return GroupAffine(
        torch.from_numpy(codes.reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, groups)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, groups)),
    )


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)  # [blocks, 1]


def _codes(code_bytes: np.ndarray, run: int) -> np.ndarray:
    """[blocks, bytes] -> [blocks, 2 * bytes] uint8: each run of bytes gives its low nibbles, then its high."""
    runs = code_bytes.reshape(code_bytes.shape[0], -1, 1, run)
    nibbles = (runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return nibbles.reshape(code_bytes.shape[0], -1)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))  # [blocks, 8] each
    scale = d * sc.astype(np.float32)
    offset = -(dmin * m.astype(np.float32))  # q*scale + (-dm) == q*scale - dm, gguf's expression
    return _codes(blocks[:, 16:], run=32), scale, offset
