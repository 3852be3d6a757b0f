"""The rendezvous of head and workers (parallel_state), on torch builds with and without libuv."""

from __future__ import annotations

import socket
import threading

import torch
import torch.distributed as dist

from pagellm.distributed import parallel_state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_and_worker_join_on_a_torch_built_without_libuv(monkeypatch):
    real_store = dist.TCPStore
    plain = []

    def store_without_libuv(*args, use_libuv: bool = True, **kwargs):
        if use_libuv:  # what such a build says when asked for the default
            raise RuntimeError("use_libuv was requested but PyTorch was built without libuv support")
        plain.append(args[3])
        return real_store(*args, use_libuv=False, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", store_without_libuv)
    states = _two_ranks(_free_port())
    assert sorted(plain) == [False, True]  # both ends fell back to the plain store
    sums = _on_both_ranks(lambda rank: states[rank].all_reduce_(torch.tensor([float(rank + 1)])))
    assert sums[0].item() == sums[1].item() == 3.0


class _GlooWithoutHalves:
    """A Gloo group as Debian's torch builds it: all-reduce refuses bf16 / fp16 tensors, before sending."""

    def __init__(self, group):
        self.group, self.refused = group, 0

    def allreduce(self, tensors):
        if tensors[0].dtype in (torch.bfloat16, torch.float16):
            self.refused += 1
            raise RuntimeError("Invalid scalar type")
        return self.group.allreduce(tensors)


def _two_ranks(port: int) -> dict:
    states = {}
    thread = threading.Thread(target=lambda: states.setdefault(
        1, parallel_state.init_worker("127.0.0.1", port, 1, 2, timeout=30, join_timeout=30)), daemon=True)
    thread.start()
    states[0] = parallel_state.init_head("127.0.0.1", port, 2, timeout=30, join_timeout=30)
    thread.join(timeout=60)
    return states


def _on_both_ranks(fn) -> dict:
    """fn(rank) for ranks 0 and 1 at once (a collective needs both): {rank: result}."""
    results = {}
    threads = [threading.Thread(target=lambda r=rank: results.setdefault(r, fn(r)), daemon=True) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_bf16_all_reduce_where_gloo_refuses_it_sums_in_fp32_on_every_rank():
    states = _two_ranks(_free_port())
    for state in states.values():
        state.group = _GlooWithoutHalves(state.group)
    values = {0: torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
              1: torch.tensor([0.5, 4.0, -1.0], dtype=torch.bfloat16)}
    expected = (values[0].float() + values[1].float()).to(torch.bfloat16)
    results = _on_both_ranks(lambda rank: [states[rank].all_reduce_(values[rank].clone()) for _ in range(2)])
    for rank in (0, 1):
        assert all(r.dtype == torch.bfloat16 and torch.equal(r, expected) for r in results[rank])
        assert states[rank].group.refused == 1  # asked once; later calls go straight to fp32
