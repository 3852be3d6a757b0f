"""Runtime settings: intra-op threads capped at the physical cores of the process's CPUs; step buffers kept in
the heap."""

import ctypes
import platform
import os

import pytest
import torch

from pagellm.platform import keep_step_buffers_in_heap, limit_threads_to_cores, physical_cores


def test_physical_cores_within_the_affinity_mask():
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_threads_capped_but_a_lower_user_choice_kept(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(physical_cores() + 3)
        limit_threads_to_cores()
        assert torch.get_num_threads() == physical_cores()
        torch.set_num_threads(1)
        limit_threads_to_cores()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _in_brk_heap(address: int) -> bool:
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


_LIBC = platform.libc_ver()  # ("glibc", "2.36"); ("", "") where the C library is another
GLIBC = f"glibc {_LIBC[1]}" if _LIBC[0] == "glibc" else None
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@pytest.mark.skipif(not (GLIBC or "").startswith("glibc"), reason="mallopt's settings are glibc's (not musl's)")
def test_step_sized_buffers_come_from_the_heap():
    """After keep_step_buffers_in_heap, a 64 MiB buffer (a B=64 step's fp32 logits) is carved from the heap,
    which keeps its pages when freed; glibc's default maps such a buffer afresh and unmaps it on free, so
    every step faulted all 16384 of its 4 KiB pages in again."""
    if not keep_step_buffers_in_heap():
        # The one setting a glibc refuses: an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit), which an
        # older glibc caps (2.34's malloc.c does) and 2.36 (Debian 12's) does not. Any other refusal fails here.
        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 0 and libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1, \
            f"{GLIBC} takes a 1 GiB mmap threshold, yet keep_step_buffers_in_heap() says a setting was refused"
        pytest.skip(f"{GLIBC} caps the mmap threshold at 32 MiB: step buffers of 64 MiB stay mmapped")
    buffer = torch.empty(64 << 18, dtype=torch.float32)
    assert _in_brk_heap(buffer.data_ptr())


def test_heap_tuning_off_leaves_glibc_alone():
    assert keep_step_buffers_in_heap(enabled=False) is False
