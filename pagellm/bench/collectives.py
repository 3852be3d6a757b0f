"""`pagellm bench collectives`: the cost of combining MoE / row-parallel partial outputs over ranks.

After a tensor- or expert-parallel block every rank holds a partial [N, E] output and
every rank needs the sum (attention is split by heads, so all ranks work on all
tokens). Two ways to get it, timed on the same Gloo group:
    allreduce   Gloo's allreduce (what the engine uses, parallel_state.all_reduce_)
    all-to-all  the expert-parallel pattern: all-to-all of row blocks (each rank sums
                the rows it owns: a reduce-scatter), then an all-gather to replicate
Rank 0 prints ms per combine (min over rounds); workers are local processes.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from pagellm.bench.arguments import add_collectives_arguments
from pagellm.distributed.parallel_state import ParallelState, init_head, init_worker
from pagellm.distributed.worker import free_port

_TIMEOUT = 60.0


def _all_to_all_combine(state: ParallelState, partial: torch.Tensor) -> torch.Tensor:
    world = state.world_size
    rows = partial.shape[0] // world
    received = torch.empty_like(partial)
    state.group.alltoall_base(received, partial, [rows] * world, [rows] * world).wait()
    owned = received.view(world, rows, -1).sum(0)  # [N/W, E]: this rank's rows, summed
    full = torch.empty_like(partial)
    state.group._allgather_base(full, owned.contiguous()).wait()
    return full


def _time(fn, rounds: int) -> float:
    fn()  # warm-up: connections, allocations
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        best = min(best, (time.perf_counter() - start) / 10)
    return best * 1e3


def measure(state: ParallelState, rows_list: list[int], hidden: int, dtype: torch.dtype, rounds: int) -> list[dict]:
    results = []
    for rows in rows_list:
        rows = -(-rows // state.world_size) * state.world_size  # the all-to-all splits rows evenly
        partial = torch.randn(rows, hidden, dtype=dtype)
        cases = {"allreduce": lambda: state.all_reduce_(partial.clone()),
                 "all-to-all": lambda: _all_to_all_combine(state, partial)}
        results.append({"N": rows, **{name: _time(fn, rounds) for name, fn in cases.items()}})
    return results


def run(world_size: int, rows_list: list[int], hidden: int, dtype_name: str, rounds: int,
        rank: int = 0, port: int = 0) -> list[dict] | None:
    dtype = getattr(torch, dtype_name)
    if rank:
        state = init_worker("127.0.0.1", port, rank, world_size, _TIMEOUT, _TIMEOUT)
        measure(state, rows_list, hidden, dtype, rounds)
        return None
    port = free_port("127.0.0.1")
    torch.set_num_threads(1)
    args = ["--world-size", str(world_size), "--rows", ",".join(map(str, rows_list)), "--hidden", str(hidden),
            "--dtype", dtype_name, "--rounds", str(rounds), "--port", str(port)]
    workers = [subprocess.Popen([sys.executable, "-m", "pagellm.bench.collectives", "--rank", str(r), *args])
               for r in range(1, world_size)]
    try:
        state = init_head("127.0.0.1", port, world_size, _TIMEOUT, _TIMEOUT)
        return measure(state, rows_list, hidden, dtype, rounds)
    finally:
        for proc in workers:
            proc.wait(_TIMEOUT)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="pagellm.bench.collectives")
    add_collectives_arguments(parser)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.world_size, args.rows, args.hidden, args.dtype, args.rounds, args.rank, args.port)


if __name__ == "__main__":
    main()
