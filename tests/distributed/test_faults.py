"""A worker that dies is found by its exit status, one that hangs by the collective timeout: the step fails with
a clear error naming which, nothing hangs, no process is left behind, and a server turns unhealthy and fails its
in-flight requests."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pagellm import SamplingParams
from pagellm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagellm.distributed.parallel_state import DistributedError
from pagellm.engine import LLMEngine
from tests.server.server_harness import start_server

TIMEOUT = 5.0  # distributed_timeout of these engines: Gloo's collective timeout and the heartbeat's period x 4
# The hung-worker test waits out its whole timeout: shorter there, still far above a tiny model's step (ms) and a
# busy machine's scheduling delays. The server's ranks step the embedded model, so it keeps TIMEOUT.
HUNG_TIMEOUT = 3.0
HANG_GUARD = 120  # seconds: only so that a missed detection fails instead of blocking; no speed is measured


def _engine(path, timeout: float = TIMEOUT) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(model=str(path)), cache=CacheConfig(kv_cache_memory=0.01),
                          parallel=ParallelConfig(tensor_parallel_size=2, distributed_timeout=timeout))
    return LLMEngine(config, skip_tokenizer_init=True)


def _step_until_it_fails(engine: LLMEngine) -> DistributedError:
    """Step the running request until the engine raises (200 tokens: ample, so finishing instead is a failure)."""
    with pytest.raises(DistributedError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    return info.value


def test_worker_killed_mid_run_fails_the_step_naming_its_exit(checkpoint):
    """A dead worker is found by its exit status (the poll path), not by waiting out the collective timeout."""
    engine = _engine(checkpoint("llama"))
    worker = engine.executor.workers.procs[1]
    try:
        engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=200, temperature=0.0))
        for _ in range(3):
            engine.step()
        worker.kill()
        error = _step_until_it_fails(engine)
        assert str(error) == f"tensor-parallel worker lost: worker rank 1 (pid {worker.pid}) exited with code -9"
        with pytest.raises(DistributedError):  # and stays failed: no step runs on a partial model
            engine.step()
    finally:
        engine.shutdown()
    assert worker.poll() is not None


@pytest.mark.timeout(2 * HANG_GUARD)  # hang guard (with 2 workers to start): a collective without its timeout
# would wait forever
def test_hung_worker_fails_the_step_by_the_collective_timeout(checkpoint):
    """A stopped worker does not exit: only the configured timeout, reaching Gloo's collective, can fail the step
    (Gloo names the wait it gave up on: "Timed out waiting 3000ms")."""
    engine = _engine(checkpoint("llama"), HUNG_TIMEOUT)
    worker = engine.executor.workers.procs[1]
    try:
        engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=200, temperature=0.0))
        engine.step()
        worker.send_signal(signal.SIGSTOP)
        error = _step_until_it_fails(engine)
        assert str(error).startswith("tensor-parallel step failed: ")  # not "worker lost": nothing exited
        assert f"Timed out waiting {HUNG_TIMEOUT * 1000:.0f}ms" in str(error), str(error)
        assert worker.poll() is None  # still there, stopped: the timeout path found it, not an exit status
    finally:
        worker.send_signal(signal.SIGCONT)
        engine.shutdown()
    assert worker.wait() == 1  # it finds the head gone too, and exits (the mark above guards a hang here too)


def test_worker_killed_while_idle_is_noticed_without_a_step(checkpoint):
    engine = _engine(checkpoint("llama"))
    worker = engine.executor.workers.procs[1]
    try:
        worker.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + HANG_GUARD  # hang guard: the heartbeat thread polls every TIMEOUT / 16 s
        while engine.executor.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(engine.executor.failure) == (f"tensor-parallel worker lost: worker rank 1 (pid {worker.pid}) "
                                                f"exited with code -9")
    finally:
        engine.shutdown()


def _children(pid: int) -> list[int]:
    """Child processes of pid, whichever of its threads started them (the engine thread spawns workers)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _is_worker(pid: int) -> bool:
    """A `pagellm worker` process (not, say, multiprocessing's resource tracker, which Python 3.14 starts)."""
    return b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def test_server_turns_unhealthy_and_fails_requests_when_a_worker_dies(tmp_path):
    server = start_server(["--kv-cache-memory", "0.05", "--max-model-len", "256", "--tensor-parallel-size", "2",
                           "--distributed-timeout", str(TIMEOUT)], tmp_path)
    try:
        body = {"model": "gemma-3-270m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        (worker,) = [pid for pid in _children(server.proc.pid) if _is_worker(pid)]
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + HANG_GUARD  # hang guard: the heartbeat finds it within about TIMEOUT
        health = httpx.get(server.url + "/health", timeout=10)
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "worker rank 1" in health.json()["error"]["message"]
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503 and "worker rank 1" in refused.json()["error"]["message"]
        server.signal(signal.SIGTERM)  # and it still shuts down cleanly
        assert server.wait_exit(60) == 0
    finally:
        server.kill()
