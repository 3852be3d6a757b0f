"""Intra-op threads are capped at the physical cores of the process's CPUs."""

import os

import torch

from pagellm.engine import limit_threads_to_cores, physical_cores


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
