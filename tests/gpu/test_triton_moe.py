"""The grouped MoE launches over experts in GGUF planes (kernels/gpu/moe.py), under Triton's interpreter on a
CPU: the pairs' alignment by expert, and every expert at once against the dense experts of the same weights."""

from __future__ import annotations

import importlib

import pytest
import torch

from pagellm.kernels.reference import gguf_planes
from pagellm.layers.moe import MoeExperts
from pagellm.loader.gguf_planes import planes_of
from tests.gpu import DEVICE, under_interpreter
from tests.kernels.gguf_blocks_builders import gguf_tensor
from tests.loader.gguf_builders import T

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")


def _moe():
    return under_interpreter(lambda: importlib.import_module("pagellm.kernels.gpu.moe"))


def test_pairs_are_grouped_by_expert_in_whole_blocks():
    """Each expert's pairs (token order kept) fill whole blocks padded with P; experts without pairs get no
    block; blocks past the last are -1. Ties: one expert takes most pairs."""
    moe = _moe()
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1], [1, 4]] * 4, device=DEVICE)  # expert 5 of 6: no pairs
    aligned, experts = moe.align_by_expert(ids, 6)
    pairs, block = ids.numel(), moe.BLOCK_M
    assert aligned.numel() == pairs + 6 * (block - 1) and experts.numel() == -(-aligned.numel() // block)
    flat = ids.flatten().tolist()
    seen = []
    for b, expert in enumerate(experts.tolist()):
        rows = [p for p in aligned[b * block:(b + 1) * block].tolist() if p < pairs]
        if expert < 0:
            assert not rows
            continue
        assert all(flat[p] == expert for p in rows) and rows == sorted(rows)
        seen += rows
    assert sorted(seen) == list(range(pairs))  # every pair once
    assert 5 not in experts.tolist() and experts.tolist()[-1] == -1


def _experts(num_experts: int, hidden: int, inter: int):
    """(stacked planes of gate_up Q4_K and down Q6_K, the same weights as a dense MoeExperts)."""
    gate_up = [planes_of(gguf_tensor(T.Q4_K, 2 * inter, hidden, seed=e), T.Q4_K, (2 * inter, hidden))
               for e in range(num_experts)]
    down = [planes_of(gguf_tensor(T.Q6_K, hidden, inter, seed=100 + e), T.Q6_K, (hidden, inter))
            for e in range(num_experts)]
    dense = MoeExperts(num_experts, hidden, inter, "silu")
    dense.gate_up_proj.data = torch.stack([gguf_planes.dequantize(p) for p in gate_up]).to(DEVICE)
    dense.down_proj.data = torch.stack([gguf_planes.dequantize(p) for p in down]).to(DEVICE)
    stacked = [tuple(torch.stack(t).to(DEVICE) for t in zip(*(p.tensors() for p in ws))) for ws in (gate_up, down)]
    return ((stacked[0], T.Q4_K, 2 * inter, hidden), (stacked[1], T.Q6_K, hidden, inter)), dense


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_every_expert_at_once_equals_the_dense_experts(tokens):
    moe = _moe()
    (gate_up, down), dense = _experts(6, 256, 256)
    generator = torch.Generator().manual_seed(tokens)
    x = 0.01 * torch.randn(tokens, 256, generator=generator).to(DEVICE)  # random blocks' weights run to ~10
    ids = torch.stack([torch.randperm(5, generator=generator)[:2] for _ in range(tokens)]).to(DEVICE)  # 5: empty
    weights = torch.rand(tokens, 2, generator=generator).to(DEVICE)
    got = moe.planes_experts(x, weights, ids, gate_up, down, dense.act_mul())
    expected = dense(x, weights, ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("normalize", [True, False])
def test_the_fused_router_picks_and_weighs_as_torch(normalize):
    """Softmax, top-k and the renormalisation in one launch, against layers/moe.route: 37 experts (a partial
    block); a token whose logits tie picks the lower expert ids, in order."""
    from pagellm.layers.moe import route

    moe = _moe()
    logits = torch.randn(9, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[4] = 0.0
    logits[4, [3, 20, 30]] = 2.0  # three equal leaders, then 34 equal others
    weights, ids = moe.route(logits, 4, normalize)
    expected_weights, expected_ids = route(logits, 4, normalize)
    assert ids[4].tolist() == [3, 20, 30, 0]
    rows = [r for r in range(9) if r != 4]  # torch's order among ties is its own
    assert torch.equal(ids[rows], expected_ids[rows])
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
