"""ParallelState: one object per process holding its rank, the process group and the rendezvous store.

Never a global: the engine (head, rank 0) and each worker own theirs and pass it
to what needs it (the all-reduce hooks, the step broadcaster). The process groups
are built directly on a TCPStore instead of `init_process_group`, so a process may
hold several engines (tests do) and nothing lives in torch's global registry:
torch.distributed's Gloo backend on every rank, for the step messages (CPU tensors)
and a CPU model's collectives; and, for a model on CUDA, an NCCL group for the
collectives on its tensors (vLLM's device group beside its CPU group), rank r on
GPU r of its host (`runner/backend.rank_device`). The NCCL path has not run: it needs two GPUs.

Start-up (all bounded by `join_timeout`):
    head    TCPStore master on (addr, port); writes the world size; waits until
            every rank has written `joined/<rank>`, polling for errors a worker
            wrote and for spawned workers that died; then builds the group.
    worker  connects to the store (unreachable head -> ConnectionError), checks
            the world size against its own (mismatch -> ValueError, also written
            to the store so the head reports it), writes `joined/<rank>`, builds
            the group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

_WORLD_KEY = "pagellm/world_size"
_ERRORS_KEY = "pagellm/errors"


class DistributedError(RuntimeError):
    """A rank failed, hung past the timeout, or could not join: the parallel engine cannot go on."""


_HALF_DTYPES = (torch.bfloat16, torch.float16)


class ParallelState:
    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: float):
        self.rank, self.world_size, self.store, self.timeout = rank, world_size, store, timeout
        self._reduce_halves_in_fp32 = False  # set once Gloo refuses a bf16 / fp16 all-reduce
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("pagellm/group", store), rank, world_size,
                                           timedelta(seconds=timeout))
        self.device_group = None  # NCCL, for collectives on the model's tensors (use_device)
        self.device: torch.device | None = None

    def use_device(self, device: torch.device, collective: str) -> None:
        """The model runs on `device` (every rank calls this, once the config is known), its collectives over
        `collective` (runner/backend.Backend.collective): "nccl" (CUDA, as vLLM's) gets a group of its own, for
        tensors on that device; Gloo keeps the step messages and heartbeats. NCCL connects on the first
        collective."""
        self.device = device
        if collective == "nccl" and self.device_group is None:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.timeout)
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("pagellm/nccl", self.store), self.rank,
                                                      self.world_size, options)

    def close(self) -> None:
        """Release the NCCL communicators (torch warns about, and may hang on, a group destroyed unshut)."""
        if self.device_group is not None:
            self.device_group.shutdown()
            self.device_group = None

    def _group_of(self, tensor: torch.Tensor):
        return self.device_group if self.device_group is not None and tensor.device == self.device else self.group

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks in place (every rank calls this in the same order).

        NCCL's allreduce for a CUDA tensor, Gloo's own otherwise. A hand-written pairwise send/recv exchange was tried and dropped: it
        was slower (README, Tensor and expert parallel).
        measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
        """
        group = self._group_of(tensor)
        if group is self.device_group:  # NCCL sums 16-bit floats itself
            group.allreduce([tensor]).wait()
            return tensor
        if tensor.dtype not in _HALF_DTYPES or not self._reduce_halves_in_fp32:
            try:
                group.allreduce([tensor]).wait()
                return tensor
            except RuntimeError as exc:
                # Gloo without 16-bit floats (Debian's torch): refused on every rank alike before anything is
                # sent, so all ranks fall back together, here and for every later call.
                if tensor.dtype not in _HALF_DTYPES or "Invalid scalar type" not in str(exc):
                    raise
                self._reduce_halves_in_fp32 = True
        wide = tensor.float()  # summed in fp32 and rounded once: for two ranks the same bits
        group.allreduce([wide]).wait()
        return tensor.copy_(wide)

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets every rank's [N, C] side by side ([N, W·C], in rank order); others get theirs back."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        group = self._group_of(tensor)
        if self.rank != 0:
            group.gather([], [tensor], opts).wait()
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        group.gather([pieces], [tensor], opts).wait()
        return torch.cat(pieces, dim=1)

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype on all ranks)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()
        return tensor


def check_local_gpus(device: str, world_size: int, gpus: int | None = None) -> None:
    """Ranks spawned on this host need a GPU each (NCCL refuses two ranks on one GPU): a clear error first."""
    if torch.device(device).type != "cuda":  # nothing to count: CPU ranks share the host
        return
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if world_size > gpus:
        raise ValueError(f"tensor_parallel_size {world_size} on this host needs {world_size} GPUs, one per rank; "
                         f"it has {gpus}")


def _use_loopback_if_local(addr: str) -> None:
    """Gloo picks its interface from the hostname; for a loopback master use lo, which always resolves."""
    if addr in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def _tcp_store(addr: str, port: int, is_master: bool, timeout: float, **kwargs) -> dist.TCPStore:
    """torch's TCPStore, on libuv where this torch has it. Builds without libuv (Debian's, some source builds)
    refuse the default use_libuv=True; the plain store speaks the same protocol, so head and workers mix."""
    try:
        return dist.TCPStore(addr, port, None, is_master, timedelta(seconds=timeout), **kwargs)
    except RuntimeError as exc:
        if "libuv" not in str(exc):
            raise
        return dist.TCPStore(addr, port, None, is_master, timedelta(seconds=timeout), use_libuv=False, **kwargs)


def init_head(addr: str, port: int, world_size: int, timeout: float, join_timeout: float,
              check_workers: Callable[[], None] = lambda: None) -> ParallelState:
    """Rank 0: serve the rendezvous store and wait for every worker to join."""
    _use_loopback_if_local(addr)
    try:
        store = _tcp_store(addr, port, True, join_timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise DistributedError(f"cannot listen on {addr}:{port} for workers: {exc}") from exc
    store.set(_WORLD_KEY, str(world_size))
    store.add(_ERRORS_KEY, 0)
    joined = [f"pagellm/joined/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + join_timeout
    while not store.check(joined):
        _raise_worker_errors(store)
        check_workers()
        if time.monotonic() > deadline:
            missing = [key.rsplit("/", 1)[1] for key in joined if not store.check([key])]
            raise DistributedError(f"worker rank(s) {', '.join(missing)} did not join {addr}:{port} within "
                                   f"{join_timeout:.0f} s (world size {world_size})")
        time.sleep(0.05)
    return ParallelState(0, world_size, store, timeout)


def _raise_worker_errors(store: dist.Store) -> None:
    count = store.add(_ERRORS_KEY, 0)
    if count:
        messages = [store.get(f"pagellm/error/{i}").decode() for i in range(1, count + 1)]
        raise DistributedError("a worker could not join: " + "; ".join(messages))


def init_worker(addr: str, port: int, rank: int, world_size: int, timeout: float,
                join_timeout: float) -> ParallelState:
    """Rank >= 1: join the head's store, check the world size, build the group."""
    if not 1 <= rank < world_size:
        raise ValueError(f"rank must be in [1, world_size={world_size}) for a worker, got {rank}")
    _use_loopback_if_local(addr)
    try:
        store = _tcp_store(addr, port, False, join_timeout)
    except (RuntimeError, OSError) as exc:
        raise ConnectionError(f"cannot reach the head at {addr}:{port} within {join_timeout:.0f} s: {exc}") from exc
    expected = int(store.get(_WORLD_KEY))
    if expected != world_size:
        message = f"rank {rank} was started with world size {world_size}, the head has {expected}"
        store.set(f"pagellm/error/{store.add(_ERRORS_KEY, 1)}", message)
        raise ValueError(message)
    store.set(f"pagellm/joined/{rank}", "1")
    return ParallelState(rank, world_size, store, timeout)
