"""Workers: `pagellm worker` (rank >= 1) and the head's start-up of a parallel group.

Start-up goes through the rendezvous store, not collectives, because loading a
model can take longer than the collective timeout:
    head     init_head (waits for every rank to join) -> store `setup` (EngineConfig)
             -> loads its shard -> store `runner` (KV blocks, state slots: the head
             sizes the cache so all ranks agree) -> waits for `ready/<rank>`
    worker   init_worker -> reads `setup` -> loads its shard -> reads `runner`
             -> builds its ModelRunner -> `ready/<rank>` -> step loop
The step loop receives frames (executor.py) until SHUTDOWN; any failure (head
gone, timeout) ends the process with an error message and exit code 1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from pagellm.config import EngineConfig
from pagellm.distributed.executor import HEARTBEAT, SHUTDOWN, STEP, heartbeat, receive_frame
from pagellm.distributed.parallel_state import (DistributedError, ParallelState, check_local_gpus, init_head,
                                               init_worker)
from pagellm.distributed.protocol import decode_step
from pagellm.distributed.sharding import ShardSpec, install_all_reduce, vocab_parallel_logits

if TYPE_CHECKING:
    from pagellm.runner.model_runner import RunnerSetup

logger = logging.getLogger("pagellm.distributed")

_SETUP_KEY, _RUNNER_KEY = "pagellm/setup", "pagellm/runner"


def free_port(addr: str) -> int:
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the head process dies, so no worker is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the head's shutdown still stops its workers


class LocalWorkers:
    """Worker processes spawned on this host (`tensor_parallel_size` > 1 with spawn_workers)."""

    def __init__(self, addr: str, port: int, world_size: int, timeout: float, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.procs = {rank: subprocess.Popen(
            [sys.executable, "-m", "pagellm", "worker", "--master-addr", addr, "--master-port", str(port),
             "--rank", str(rank), "--world-size", str(world_size), "--distributed-timeout", str(timeout)],
            env=env, preexec_fn=_die_with_parent) for rank in range(1, world_size)}

    def exited(self, wait: float = 0.0) -> str | None:
        """A description of the first worker that has exited (within `wait` seconds), else None."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    return f"worker rank {rank} (pid {proc.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def check(self) -> None:
        dead = self.exited()
        if dead:
            raise DistributedError(dead)

    def stop(self, grace: float = 5.0) -> None:
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_head(config: EngineConfig) -> tuple[ParallelState, LocalWorkers | None]:
    """Rank 0: spawn local workers (or wait for remote ones), then publish the engine config."""
    pc = config.parallel
    world = pc.tensor_parallel_size
    port = pc.master_port or free_port(pc.master_addr)
    workers = None
    if pc.spawn_workers:
        check_local_gpus(config.model.device, world)
        threads = max(1, torch.get_num_threads() // world)
        torch.set_num_threads(threads)  # the ranks share this host's cores
        workers = LocalWorkers(pc.master_addr, port, world, pc.distributed_timeout, threads)
    try:
        state = init_head(pc.master_addr, port, world, pc.distributed_timeout, pc.join_timeout,
                          workers.check if workers else lambda: None)
    except BaseException:
        if workers is not None:
            workers.stop(grace=0)
        raise
    state.store.set(_SETUP_KEY, pickle.dumps(config))
    return state, workers


def publish_runner_setup(state: ParallelState, setup: RunnerSetup, workers: LocalWorkers | None,
                         join_timeout: float) -> None:
    """Hand the cache sizes to the workers and wait until every one has built its runner."""
    state.store.set(_RUNNER_KEY, pickle.dumps(setup))
    ready = [f"pagellm/ready/{rank}" for rank in range(1, state.world_size)]
    deadline = time.monotonic() + join_timeout
    while not state.store.check(ready):
        if workers is not None:
            workers.check()
        if time.monotonic() > deadline:
            raise DistributedError(f"workers did not load the model within {join_timeout:.0f} s")
        time.sleep(0.05)


def run_worker(addr: str, port: int, rank: int, world_size: int, timeout: float, join_timeout: float) -> int:
    from pagellm.platform import keep_step_buffers_in_heap, limit_threads_to_cores, release_cuda_library_pages
    from pagellm.loader.model_loader import load_model
    from pagellm.runner.backend import choose_backend
    from pagellm.runner.model_runner import ModelRunner, RankLinks, RunnerSetup

    limit_threads_to_cores()
    state = init_worker(addr, port, rank, world_size, timeout, join_timeout)
    state.store.set_timeout(timedelta(seconds=join_timeout))
    config: EngineConfig = pickle.loads(state.store.get(_SETUP_KEY))
    mc = config.model
    backend = choose_backend(config, rank)  # the head's choice, derived alike (its level checked on this CPU)
    device = backend.device
    if backend.captures_graphs:  # Triton launches on the current device, not the tensors' (and NCCL binds it)
        torch.cuda.set_device(device)
    state.use_device(device, backend.collective)
    shard = ShardSpec(rank, world_size, config.parallel.enable_expert_parallel)
    model = load_model(mc.model, backend.compute_dtype, device, with_tokenizer=False, quantization=mc.quantization,
                       shard=shard, kernels=config.kernels, load_format=mc.load_format,
                       state_dtype=config.cache.mamba_ssm_cache_dtype).model
    install_all_reduce(model, state.all_reduce_)
    setup: RunnerSetup = pickle.loads(state.store.get(_RUNNER_KEY))
    # the head's decision on the LM head: same model and world
    links = RankLinks(state.all_reduce_, vocab_parallel_logits(model, state), samples=False)
    runner = ModelRunner(model, config, backend, setup, links)
    keep_step_buffers_in_heap(config.kernels.heap_tuning)
    release_cuda_library_pages(device)  # torch links them; a CPU rank runs none of them
    state.store.set(f"pagellm/ready/{rank}", "1")
    return _serve_steps(state, runner)


def _serve_steps(state: ParallelState, runner) -> int:
    steps = 0
    while True:
        try:
            kind, payload = receive_frame(state)
            if kind == STEP:
                runner.execute(decode_step(payload))
                steps += 1
            elif kind == HEARTBEAT:
                heartbeat(state)
            elif kind == SHUTDOWN:
                return 0
            else:
                raise DistributedError(f"unknown frame kind {kind}")
        except RuntimeError as exc:  # the head died or stopped answering (collective timeout)
            print(f"pagellm worker rank {state.rank}: lost the head after {steps} steps: "
                  f"{str(exc).splitlines()[0]}", file=sys.stderr)
            return 1
