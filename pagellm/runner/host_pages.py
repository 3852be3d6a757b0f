r"""Host pages of the KV pool and the state rows: reserved page-aligned, handed back to the OS row by row.

On a CPU the KV pool is address space: a block's pages become resident when a step first writes it. When the
core releases blocks past the prefix cache's budget (core/block_pool.py), MADV_DONTNEED drops their pages: the
kernel frees them at once, and the next write faults in zeroed ones. Every layer's tensor is released over the
same rows, one call per run of consecutive rows:

    key cache of one layer (rows = blocks, each block_size x H_kv x D):
    | page | page | page | page | page | page | ...
    [ blk 0     ][ blk 1     ][ blk 2     ][ blk 3 ...
                 ^-- released: only the pages wholly inside a run go, so a page shared with a live
                     neighbour (blocks smaller than a page, or not page-multiples) stays

Tensors are allocated page-aligned so that when a row is a whole number of pages (Gemma 3 270M's fp16 blocks
of 16 tokens are two pages per layer) a release frees it all. On a GPU nothing is released: device memory is
reserved whole at start.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Sequence

import torch

PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # from Linux's <sys/mman.h>


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, starting on a page boundary (torch aligns to 64 bytes only). Nothing is written:
    the pages stay unresident until used."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % PAGE
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def _madvise():
    """libc's madvise on Linux, else None (releases are skipped): elsewhere MADV_DONTNEED may keep the pages."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending rows as [start, end) runs of consecutive ones: (3, 4, 5, 9) -> [(3, 6), (9, 10)]."""
    runs: list[tuple[int, int]] = []
    for row in sorted(rows):
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


class HostPages:
    """Releases rows of a set of CPU tensors that share their first dimension's meaning (every layer's key and
    value cache: rows are KV blocks; every state layer's conv and recurrent state: rows are state rows). None
    given (device memory, reserved whole): nothing is released."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self._madvise = _madvise() if self.tensors else None
        self.released_bytes_total = 0

    def release(self, rows: Sequence[int]) -> int:
        """Hand the pages lying wholly inside these rows back to the OS, in every tensor; returns the bytes. The
        rows' contents are lost (read back as zeros)."""
        if not rows or self._madvise is None:
            return 0
        released = 0
        runs = row_runs(rows)
        for tensor in self.tensors:
            row_bytes, base = tensor.stride(0) * tensor.element_size(), tensor.data_ptr()
            for start, end in runs:
                first = -(-(base + start * row_bytes) // PAGE) * PAGE  # the first whole page inside the run
                last = (base + end * row_bytes) // PAGE * PAGE
                if last > first and self._madvise(first, last - first, _MADV_DONTNEED) == 0:
                    released += last - first
        self.released_bytes_total += released
        return released
