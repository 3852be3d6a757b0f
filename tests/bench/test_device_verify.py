"""bench/device_verify.py: a B=1 verify step timed against a decode step over the runner's own buffers (on a CPU
with the replaying stand-in for graphs: what a GPU run replays)."""

from __future__ import annotations

import argparse

import pagellm.engine as engine_module
from pagellm.bench import batched
from pagellm.bench.device_verify import step_costs, verify_cost
from pagellm.config import SpeculativeConfig
from tests.models.tiny_checkpoints import write_tiny_checkpoint
from tests.runner.test_decode_buckets import ReplayingRecorder, _runner_with


def test_the_verify_step_is_timed_against_the_decode_step_both_replayed(tmp_path, monkeypatch):
    write_tiny_checkpoint("llama", tmp_path)
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)
    engine = batched.build_engine(str(tmp_path), None, 1, 40, 1, speculative=spec)
    try:
        recorder = ReplayingRecorder()
        engine.runner.decode_graphs.capture(recorder)
        engine.runner.verify_graphs.capture(recorder)
        result = step_costs(engine, drafts=4, context=24, repeats=3)
        replays = engine.runner.decode_graphs.replays, engine.runner.verify_graphs.replays
    finally:
        engine.shutdown()
    assert result["padded_to"] == (1, 4) and result["decode_ms"] > 0 and result["verify_ms"] > 0
    assert result["ratio"] == result["verify_ms"] / result["decode_ms"] and result["replayed"]
    assert replays == (4, 4)  # a warm-up and three rounds of each


def test_without_decode_graphs_nothing_is_timed(tmp_path):
    """A CPU engine runs no graphs: the check says so rather than timing eager steps."""
    write_tiny_checkpoint("llama", tmp_path)
    args = argparse.Namespace(dtype=None, device="cpu", kv_cache_memory=0.01)
    assert "not_run" in verify_cost(args, tmp_path, drafts=2, context=16, repeats=1)
