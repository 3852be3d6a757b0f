"""The rendezvous of head and workers (parallel_state), on torch builds with and without libuv."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pagellm.distributed import parallel_state
from pagellm.runner import backend


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


def test_each_rank_runs_on_its_own_gpu_and_a_cpu_model_on_the_cpu():
    """Tensor parallel on CUDA places rank r on GPU r of its host (as vLLM); one GPU named for several ranks is a
    clear error, not every rank on that GPU."""
    assert backend.rank_device("cpu", 1, 2) == torch.device("cpu")
    assert [backend.rank_device("cuda", r, 4, gpus=4) for r in range(4)] == [
        torch.device("cuda", r) for r in range(4)]
    assert backend.rank_device("cuda:1", 0, 1) == torch.device("cuda", 1)  # one rank: the GPU named
    with pytest.raises(ValueError, match=r"^device: tensor parallel over 2 GPUs takes device 'cuda'"):
        backend.rank_device("cuda:1", 0, 2, gpus=2)


class _OnCuda(torch.Tensor):
    @property
    def device(self):
        return torch.device("cuda", 0)


def test_collectives_on_cuda_tensors_go_through_nccl(monkeypatch):
    """On CUDA the model's collectives run in an NCCL group built over the same store (with the timeout), CPU
    tensors (the step messages, a CPU model) in Gloo. NCCL itself cannot run here (it needs GPUs, two for a
    real exchange): a recording stand-in takes its place."""
    built, reduced = [], []

    class NcclOptions:
        _timeout = None

    class RecordingNCCL:
        Options = NcclOptions

        def __init__(self, store, rank, size, options):
            built.append((rank, size, options._timeout))

        def allreduce(self, tensors):
            reduced.append(tensors[0])
            return SimpleNamespace(wait=lambda: None)

        def shutdown(self):
            built.append("shutdown")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingNCCL, raising=False)
    state = parallel_state.ParallelState(0, 1, dist.HashStore(), timeout=12)
    state.use_device(torch.device("cpu"), "gloo")
    assert state.device_group is None and built == []
    state.use_device(torch.device("cuda", 0), "nccl")
    assert built == [(0, 1, timedelta(seconds=12))]
    state.close()  # the communicators released at shutdown
    assert state.device_group is None and built[-1] == "shutdown"
    state.use_device(torch.device("cuda", 0), "nccl")
    on_gpu = torch.Tensor._make_subclass(_OnCuda, torch.ones(3, dtype=torch.bfloat16))
    assert state.all_reduce_(on_gpu) is on_gpu and reduced == [on_gpu]  # bf16 as it is: NCCL sums it
    assert state.all_reduce_(torch.ones(2)).tolist() == [1.0, 1.0] and len(reduced) == 1  # Gloo, world of one


def test_ranks_over_hosts_take_their_gpus_in_rank_order_and_spawned_ranks_need_one_each():
    assert [backend.rank_device("cuda", r, 4, gpus=2) for r in range(4)] == [
        torch.device("cuda", r % 2) for r in range(4)]  # two hosts of two GPUs
    with pytest.raises(ValueError, match="this host sees no GPU"):
        backend.rank_device("cuda", 1, 2, gpus=0)
    parallel_state.check_local_gpus("cuda", 2, gpus=2)
    parallel_state.check_local_gpus("cpu", 4, gpus=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 on this host needs 2 GPUs, one per rank; it has 1"):
        parallel_state.check_local_gpus("cuda", 2, gpus=1)
