"""Executors: run a step in this process (LocalExecutor) or on every rank (HeadExecutor).

The head (rank 0) runs the scheduler. Each step it broadcasts the packed
SchedulerOutput (distributed/protocol.py) to the workers, then runs its own
shard; the ranks meet in the per-block all-reduces, and the head alone computes
logits and samples. While no step runs, a heartbeat message goes out every
`timeout / 4` seconds (followed by a one-element all-reduce: a round trip) so
idle workers never hit the collective timeout, and a dead or hung worker is
found within about `timeout` seconds even when idle.

A frame is two broadcasts: an int64 header [kind, payload bytes], then the payload.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import torch

from pagellm.core.types import ModelOutput, SchedulerOutput
from pagellm.distributed.parallel_state import DistributedError, ParallelState
from pagellm.distributed.protocol import encode_step
from pagellm.runner.model_runner import ModelRunner
from pagellm.runner.sampled_tokens import LaunchedStep

logger = logging.getLogger("pagellm.distributed")

STEP, HEARTBEAT, SHUTDOWN = 1, 2, 3
HEADER_BYTES = 16


class LocalExecutor:
    """One process: the step runs on this process's runner."""

    world_size = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.failure: DistributedError | None = None

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(output)

    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        return self.runner.launch(output)

    def collect(self, launched: LaunchedStep) -> ModelOutput:
        return self.runner.collect(launched)

    def shutdown(self) -> None:
        pass


def send_frame(state: ParallelState, kind: int, payload: bytes = b"") -> None:
    state.broadcast_(torch.tensor([kind, len(payload)], dtype=torch.int64))
    if payload:
        state.broadcast_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def receive_frame(state: ParallelState) -> tuple[int, bytes]:
    header = state.broadcast_(torch.zeros(2, dtype=torch.int64))
    kind, length = int(header[0]), int(header[1])
    if not length:
        return kind, b""
    return kind, state.broadcast_(torch.empty(length, dtype=torch.uint8)).numpy().tobytes()


def heartbeat(state: ParallelState, send: bool = False) -> None:
    """A round trip, so a hung rank (not only a dead one) fails the head's collective within the timeout."""
    if send:
        send_frame(state, HEARTBEAT)
    state.all_reduce_(torch.zeros(1))


class HeadExecutor:
    """Rank 0 of a tensor / expert parallel group."""

    def __init__(self, runner: ModelRunner, state: ParallelState, workers=None):
        self.runner, self.state, self.workers = runner, state, workers  # workers: LocalWorkers or None
        self.world_size = state.world_size
        self.failure: DistributedError | None = None
        self._lock = threading.Lock()  # one frame at a time: steps and heartbeats never interleave
        self._last_frame = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="pagellm-heartbeat", daemon=True)
        self._heartbeat.start()

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        if self.failure is not None:
            raise self.failure
        payload = encode_step(output)
        with self._lock:
            try:
                send_frame(self.state, STEP, payload)
                result = self.runner.execute(output)
            except Exception as exc:  # Gloo (peer closed, timeout), or any error that leaves the ranks
                raise self._fail(exc) from exc  # mid-step: their collectives are out of step for good
            self._last_frame = time.monotonic()
        return replace(result, message_bytes=HEADER_BYTES + len(payload))

    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """The ranks run a step in lockstep: it is done once launched (no async scheduling here)."""
        result = self.execute(output)
        return LaunchedStep(result.timings, done=result)

    def collect(self, launched: LaunchedStep) -> ModelOutput:
        return launched.done

    def _beat(self) -> None:
        interval = self.state.timeout / 4
        while not self._stop.wait(interval / 4):
            if self.failure is not None:
                return
            if self.workers is not None and (dead := self.workers.exited()):
                self._fail(RuntimeError(dead))
                return
            if time.monotonic() - self._last_frame < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                heartbeat(self.state, send=True)
                self._last_frame = time.monotonic()
            except RuntimeError as exc:
                self._fail(exc)
            finally:
                self._lock.release()

    def _fail(self, cause: Exception) -> DistributedError:
        if self.failure is None:
            dead = self.workers.exited(wait=1.0) if self.workers is not None else None  # a closed peer is
            # usually a worker that just died: give the OS a moment to report its exit, to name it
            first_line = (str(cause).splitlines() or [type(cause).__name__])[0]
            self.failure = DistributedError(f"tensor-parallel worker lost: {dead}" if dead
                                            else f"tensor-parallel step failed: {first_line}")
            logger.error("%s", self.failure)
        return self.failure

    def shutdown(self) -> None:
        self._stop.set()
        if self.failure is None:
            with self._lock:
                try:
                    send_frame(self.state, SHUTDOWN)
                except RuntimeError:
                    pass
        self._heartbeat.join(timeout=5)
        self.state.close()
        if self.workers is not None:
            self.workers.stop()
