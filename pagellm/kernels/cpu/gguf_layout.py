"""A GGUF tensor's codes in the kernels' block layout (csrc/gguf_layout.cpp), for loader/gguf_repack.py: the
same bytes as its numpy, in one pass over the codes and on every thread. Where the kernel does not build (native
kernels off, no compiler) the numpy stays; the layout is the same at every level.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import Address, Function, Int, Tensor

_BYTES = (torch.uint8,)
_CODE_BYTES = Function("pagellm_gguf_code_bytes", (Tensor("codes", _BYTES), Int("n"), Int("cols"), Int("bits"),
                                                   Tensor("out", _BYTES)), returns=ctypes.c_int)
SOURCE = "gguf_layout"  # csrc/gguf_layout.cpp: its bytes are part of a block cache entry's key
# src by address: it is often a read-only view of the file's map, which torch would warn about wrapping
_UNPACK = Function("pagellm_gguf_unpack_nibbles", (Address("src"), Int("blocks"), Int("stride"), Int("nbytes"),
                                                   Int("run"), Tensor("out", _BYTES)), returns=ctypes.c_int)
_LIBRARY = native.Library(SOURCE, [_CODE_BYTES, _UNPACK], "GGUF block layout at load")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py
GROUP_BYTES = {4: 256, 5: 320, 6: 384, 8: 512}  # a 16-row block's 32-column group: gguf_format.h


def available(at: str | None) -> bool:
    """Whether the kernel runs at level `at`."""
    return _LIBRARY.available(at)


def code_bytes(codes: np.ndarray, bits: int, at: str | None) -> np.ndarray | None:
    """[n, cols] codes (one byte each: uint8, or Q8_0's int8) -> [n / 16, cols / 32, group bytes] uint8 as
    gguf_format.h lays them out; None where the kernel does not run at level `at`."""
    call = _LIBRARY.checked(_CODE_BYTES.symbol, at)
    if call is None:
        return None
    if bits not in GROUP_BYTES:
        raise ValueError(f"bits must be one of {sorted(GROUP_BYTES)}, got {bits}")
    if codes.ndim != 2 or codes.dtype.itemsize != 1:
        raise ValueError(f"codes must be [rows, cols] of one byte each, got {codes.dtype} {codes.shape}")
    n, cols = codes.shape
    source = torch.from_numpy(np.ascontiguousarray(codes).view(np.uint8))
    # numpy's allocation, as the numpy path's: torch's for these load-time temporaries left a first start holding
    # more (docs/benchmarks/2026-11-29-moe-gguf-whole.md, section 3)
    out = np.empty((n // 16, cols // 32, GROUP_BYTES[bits]), dtype=np.uint8)
    if call(source, n, cols, bits, torch.from_numpy(out)) != 0:
        raise ValueError(f"pagellm_gguf_code_bytes refused {bits} bits for codes of shape {codes.shape}")
    return out


def unpack_nibbles(code_bytes: np.ndarray, run: int, at: str | None) -> np.ndarray | None:
    """[blocks, bytes] nibble bytes (rows may be apart: a column range of a file's blocks) -> [blocks, 2 * bytes]
    codes: each run of `run` bytes gives its low nibbles, then its high; None where the kernel does not run."""
    call = _LIBRARY.checked(_UNPACK.symbol, at)
    if call is None:
        return None
    if code_bytes.ndim != 2 or code_bytes.dtype != np.uint8 or code_bytes.strides[1] != 1:
        raise ValueError(f"code_bytes must be [blocks, bytes] uint8 rows, got {code_bytes.dtype} "
                         f"{code_bytes.shape} strides {code_bytes.strides}")
    blocks, nbytes = code_bytes.shape
    out = np.empty((blocks, 2 * nbytes), dtype=np.uint8)  # numpy's allocation, as code_bytes' (why: there)
    if call(code_bytes.ctypes.data, blocks, code_bytes.strides[0], nbytes, run, torch.from_numpy(out)) != 0:
        raise ValueError(f"pagellm_gguf_unpack_nibbles refused runs of {run} in rows of {nbytes} bytes")
    return out
