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


ENTRIES = ({"experts": 6, "hidden": 256, "intermediate": 256, "tokens": 1, "block_m": 16,
            "gate_up": {"Q4_K": [64, 64, 4]}, "down": {"Q6_K": [64, 64, 4]}},
           {"experts": 6, "hidden": 256, "intermediate": 256, "tokens": 32, "block_m": 32,
            "gate_up": {"Q4_K": [32, 32, 4]}, "down": {"Q6_K": [128, 32, 8]}})


def test_the_tile_is_the_measured_entry_of_the_shape_at_most_tokens_not_above():
    moe = _moe()
    assert moe.tile_for(6, 256, 256, 31, ENTRIES).block_m == 16 and moe.tile_for(6, 256, 256, 32, ENTRIES).block_m == 32
    big = moe.tile_for(6, 256, 256, 4096, ENTRIES)
    assert big.launch("gate_up", T.Q4_K) == (32, 32, 4) and big.launch("down", T.Q6_K) == (128, 32, 8)
    assert big.launch("down", T.Q4_K) == (*moe.TILE, 4)  # a format the entry does not name: the default
    assert moe.tile_for(7, 256, 256, 1, ENTRIES) is moe.DEFAULT_TILE  # a shape never measured
    assert moe.tile_for(6, 256, 256, 0, ENTRIES).block_m == 16  # below every entry: the fewest tokens'


def test_the_measured_tiles_are_read_from_their_file(tmp_path):
    """The file's entries (what device-check --moe-tiles-shape prints), none without a file; the repository's own
    parses."""
    import json

    moe = _moe()
    path = tmp_path / "moe_tiles.json"
    path.write_text(json.dumps({"about": "", "measured_on": "a device", "entries": list(ENTRIES)}))
    assert moe.measured_tiles(path) == ENTRIES and moe.measured_tiles(tmp_path / "none.json") == ()
    assert all(isinstance(e["tokens"], int) for e in moe.measured_tiles())


@pytest.mark.parametrize("tokens", [3, 40])
def test_the_measured_tiles_compute_what_the_default_does(tokens):
    """Blocks of 32 pairs, a 32 x 32 tile and a 128 x 32 one with 8 warps: the same experts' sum."""
    moe = _moe()
    (gate_up, down), dense = _experts(6, 256, 256)
    generator = torch.Generator().manual_seed(tokens)
    x = 0.01 * torch.randn(tokens, 256, generator=generator).to(DEVICE)
    ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, 2, generator=generator).to(DEVICE)
    tile = moe.tile_for(6, 256, 256, 32, ENTRIES)
    got = moe.planes_experts(x, weights, ids, gate_up, down, dense.act_mul(), tile)
    expected = dense(x, weights, ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
