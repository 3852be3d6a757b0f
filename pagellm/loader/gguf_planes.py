"""GGUF tensors from their file's blocks to the planes a GPU keeps (kernels/reference/gguf_planes.py), at load.

The planes are slices of the blocks' own bytes (Q4_K and Q5_K: their packed 6-bit scales unpacked to a byte
each), so a conversion is a few copies: no cache is kept for it, unlike the CPU's repacked blocks.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagellm.kernels.reference.gguf_planes import GGUFPlanes, T, supports

# where each field starts in a block, and its length in bytes: (d, dm, qh, qs) (None: the format has none)
_FIELDS = {
    T.Q4_0: ((0, 2), None, None, (2, 16)),
    T.Q4_1: ((0, 2), (2, 2), None, (4, 16)),
    T.Q5_0: ((0, 2), None, (2, 4), (6, 16)),
    T.Q5_1: ((0, 2), (2, 2), (4, 4), (8, 16)),
    T.Q8_0: ((0, 2), None, None, (2, 32)),
    T.Q4_K: ((0, 2), (2, 2), None, (16, 128)),
    T.Q5_K: ((0, 2), (2, 2), (16, 32), (48, 128)),
    T.Q6_K: ((208, 2), None, (128, 64), (0, 128)),
}
_QH_DTYPES = {T.Q5_0: np.int32, T.Q5_1: np.int32}  # one little-endian word per 32 columns; else bytes


def planes_of(data: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> GGUFPlanes:
    """The planes of a [rows, cols] tensor from its raw block bytes (`data`, as the file stores them)."""
    rows, cols = shape
    if not supports(ggml_type, rows, cols):
        raise ValueError(f"a {ggml_type.name} tensor of shape {shape} cannot be kept in planes "
                         f"(formats {sorted(t.name for t in _FIELDS)}, whole blocks per row)")
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = np.asarray(data).reshape(rows, cols // block_size, type_size)
    d_at, dm_at, qh_at, qs_at = _FIELDS[ggml_type]

    def field(at, dtype=np.uint8) -> torch.Tensor:  # [rows, blocks * bytes / itemsize]
        if at is None:
            return torch.empty((rows, 0), dtype=torch.from_numpy(np.empty(0, dtype)).dtype)
        start, length = at
        return torch.from_numpy(np.ascontiguousarray(blocks[:, :, start:start + length]).view(dtype).reshape(rows, -1))

    qs = field(qs_at, np.int8 if ggml_type == T.Q8_0 else np.uint8)
    sc, mn = field(None), field(None)
    if ggml_type in (T.Q4_K, T.Q5_K):
        scale, minimum = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        sc, mn = (torch.from_numpy(np.ascontiguousarray(v, dtype=np.uint8).reshape(rows, -1)) for v in (scale, minimum))
    elif ggml_type == T.Q6_K:
        sc = field((192, 16), np.int8)
    return GGUFPlanes(ggml_type, rows, cols, qs, field(qh_at, _QH_DTYPES.get(ggml_type, np.uint8)), sc, mn,
                      field(d_at, np.float16), field(dm_at, np.float16))
