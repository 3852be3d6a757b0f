"""The hybrid families' decode step modes give eager's greedy ids (bench/device_steps.same_ids): on a CUDA device
its captured graphs and async scheduling, over real state slots and expert routing; on a CPU async scheduling."""

import pytest

from pagellm.bench import device_steps
from tests.gpu import DEVICE, ON_GPU
from tests.models.tiny_checkpoints import write_hybrid_checkpoint


@pytest.mark.parametrize("family", ["qwen3.5-moe", "qwen3-next"])
def test_each_step_mode_gives_eagers_greedy_ids(family, tmp_path):
    write_hybrid_checkpoint(family, tmp_path)
    checks = device_steps.same_ids(DEVICE, tmp_path)
    assert set(checks) == {"eager", *device_steps.modes_for(DEVICE)}
    assert all(check["ok"] for check in checks.values()), checks
    assert checks["async"]["steps_launched_ahead"] > 0
    if ON_GPU:  # most decode steps replay a graph once the buckets are captured
        assert checks["graphs-async"]["graph_replays"] >= checks["graphs-async"]["decode_steps"] // 2, checks
