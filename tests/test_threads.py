"""Runtime settings: intra-op threads capped at the physical cores of the process's CPUs; step buffers kept in
the heap."""

import os
import sys

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


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_step_sized_buffers_come_from_the_heap():
    """After keep_step_buffers_in_heap, a 64 MiB buffer (a B=64 step's fp32 logits) is carved from the heap,
    which keeps its pages when freed; glibc's default maps such a buffer afresh and unmaps it on free, so
    every step faulted all 16384 of its 4 KiB pages in again."""
    if not keep_step_buffers_in_heap():
        pytest.skip("glibc refused the settings")
    buffer = torch.empty(64 << 18, dtype=torch.float32)
    assert _in_brk_heap(buffer.data_ptr())


def test_heap_tuning_off_leaves_glibc_alone():
    assert keep_step_buffers_in_heap(enabled=False) is False
