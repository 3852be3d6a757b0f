"""Gated DeltaNet state snapshots at block boundaries (prefix caching for hybrid models).

A snapshot written mid-chunk must equal the state of a run that stopped at that
boundary, and a request restored from it must continue exactly as the
uninterrupted run. Rows of the bound state start as NaN: anything read that
was never written shows up.
"""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.kernels.attention_metadata import AttentionMetadata
from tests.layers.tiny_delta import tiny_gated_delta_net

NUM_ROWS = 16  # running slots 0-3, snapshot rows 4-15 (the runner's layout: slots first)


@pytest.fixture(scope="module")
def layer() -> GatedDeltaNet:
    return tiny_gated_delta_net()


def _bind(layer: GatedDeltaNet) -> None:
    shapes = layer.state_shapes()
    layer.bind_state(torch.full((NUM_ROWS, *shapes.conv_state), float("nan"), dtype=shapes.conv_dtype),
                     torch.full((NUM_ROWS, *shapes.recurrent_state), float("nan")))


def _run(layer, x, start: int, slot: int, writes=()) -> torch.Tensor:
    """Feed x (tokens start.. of one request) in one step; writes = ((p, row), ...) absolute positions."""
    meta = AttentionMetadata.build([len(x)], [start + len(x)], [[0]], 1024, state_slots=[slot],
                                   snapshot_writes=tuple((0, p, row) for p, row in writes))
    with torch.inference_mode():
        return layer(x, meta)


def _state(layer, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.conv_state[row].clone(), layer.recurrent_state[row].clone()


X = torch.randn(30, 48, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("first_chunk", [0, 10], ids=["one-chunk", "continuation"])
def test_snapshot_equals_the_state_of_a_run_stopped_at_the_boundary(layer, first_chunk):
    # Boundaries 2 (inside the conv window of a fresh request), 12 (2 tokens into a continuation
    # chunk: its conv state holds the previous chunk's tail), and chunked / recurrent pieces.
    boundaries = [p for p in (2, 4, 12, 20, 28) if p > first_chunk]
    writes = [(p, 4 + i) for i, p in enumerate(boundaries)]
    _bind(layer)
    if first_chunk:
        _run(layer, X[:first_chunk], 0, slot=1)
    _run(layer, X[first_chunk:], first_chunk, slot=1, writes=writes)
    for p, row in writes:
        _run(layer, X[:p], 0, slot=2)  # reference: a request whose prompt ends at the boundary
        conv, recurrent = _state(layer, row)
        ref_conv, ref_recurrent = _state(layer, 2)
        torch.testing.assert_close(conv, ref_conv, atol=1e-6, rtol=1e-5)  # raw projected inputs
        torch.testing.assert_close(recurrent, ref_recurrent, atol=1e-5, rtol=1e-5)


def test_restored_request_continues_like_the_uninterrupted_one(layer):
    _bind(layer)
    whole = _run(layer, X, 0, slot=1)
    whole_state = _state(layer, 1)
    split = _run(layer, X, 0, slot=0, writes=[(8, 5), (16, 6)])
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-4)  # pieces change nothing but rounding
    for p, row in [(8, 5), (16, 6)]:
        layer.copy_state([row], [3])  # the runner's restore into a request's slot
        tail = _run(layer, X[p:], p, slot=3)
        torch.testing.assert_close(tail, whole[p:], atol=1e-4, rtol=1e-3)
        for got, want in zip(_state(layer, 3), whole_state):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_decode_step_ending_on_a_boundary_writes_its_snapshot(layer):
    _bind(layer)
    _run(layer, X[:7], 0, slot=0)
    _run(layer, X[:5], 0, slot=1)
    meta = AttentionMetadata.build([1, 1], [8, 6], [[0], [0]], 1024, state_slots=[0, 1],
                                   snapshot_writes=((0, 8, 9),))
    with torch.inference_mode():
        layer(torch.stack([X[7], X[5]]), meta)  # batched decode path
    for got, want in zip(_state(layer, 9), _state(layer, 0)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    others = [r for r in range(4, NUM_ROWS) if r != 9]
    assert layer.recurrent_state[others].isnan().all()  # no other snapshot row touched
