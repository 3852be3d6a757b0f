"""The Triton Gated DeltaNet prefill (kernels/gpu/gated_delta_prefill.py) against the torch reference's chunked
rule, under Triton's interpreter on a CPU: several requests in one launch, lengths on both sides of a chunk,
fresh and continued requests at any slots, snapshot rows at boundaries inside and at the end of chunks, a key head
shared by value heads, head sizes of no power of two. Rows nobody owns start as NaN: a stray read or write shows."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels.reference.gated_delta import PrefillSequence, chunked_gated_delta
from tests.gpu import DEVICE, under_interpreter

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")

K_HEADS, V_HEADS, DK, DV = 2, 4, 24, 40


def _kernels():
    return under_interpreter(lambda: importlib.import_module("pagellm.kernels.gpu.gated_delta_prefill"))


def _inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, K_HEADS, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(tokens, K_HEADS, DK, generator=gen), dim=-1)
    v = torch.randn(tokens, V_HEADS, DV, generator=gen)
    g = -torch.rand(tokens, V_HEADS, generator=gen) * 0.3
    beta = torch.rand(tokens, V_HEADS, generator=gen)
    return [t.to(DEVICE) for t in (q, k, v, g, beta)]


def _oracle(state, q, k, v, g, beta, sequences):
    """Each request alone: its pieces between snapshot boundaries through the reference's chunked rule."""
    state, out = state.clone(), torch.zeros(q.shape[0], V_HEADS, DV, device=q.device)
    heads = torch.arange(V_HEADS, device=q.device) // (V_HEADS // K_HEADS)
    for seq in sequences:
        current = torch.zeros_like(state[0]) if seq.fresh else state[seq.slot].clone()
        lo = 0
        for end, row in (*seq.snapshots, (seq.length, seq.slot)):
            if end > lo:
                span = slice(seq.start + lo, seq.start + end)
                out[span], current = chunked_gated_delta(q[span][:, heads], k[span][:, heads], v[span], g[span],
                                                         beta[span], current)
            state[row] = current
            lo = end
    return out, state


LAYOUTS = {  # (length, slot, fresh, snapshots) per request
    "mixed": [(65, 3, True, ((16, 9), (64, 10))), (1, 0, False, ()), (130, 5, False, ((128, 11), (130, 12))),
              (7, 1, True, ()), (64, 6, False, ((3, 13),))],  # a chunk and one token, two chunks and one, ...
    # a speculative verify step: 1 + 3 tokens, the state kept after the decode and each draft
    "verify-like": [(4, 2, False, ((1, 9), (2, 10), (3, 11))), (4, 0, False, ((1, 12), (2, 13), (3, 14)))]}


def _requests(case: str, state_dtype: torch.dtype = torch.float32):
    """The case's sequences, their tokens' count, and 16 state rows: NaN but the continued requests' slots."""
    sequences, start = [], 0
    for length, slot, fresh, snapshots in LAYOUTS[case]:
        sequences.append(PrefillSequence(start, length, slot, fresh, snapshots))
        start += length
    gen = torch.Generator().manual_seed(7)
    state = torch.full((16, V_HEADS, DK, DV), float("nan"))
    for seq in sequences:
        if not seq.fresh:
            state[seq.slot] = torch.randn(V_HEADS, DK, DV, generator=gen) * 0.3
    return sequences, start, state.to(state_dtype).to(DEVICE)


@pytest.mark.parametrize("case", LAYOUTS)
def test_the_prefill_equals_each_request_through_the_reference(case):
    kernels = _kernels()
    sequences, start, state = _requests(case)
    q, k, v, g, beta = _inputs(start, seed=8)
    want_out, want_state = _oracle(state, q, k, v, g, beta, sequences)
    out = kernels.rule_prefill_(state, q, k, v, g, beta, sequences)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-4)
    written = sorted({seq.slot for seq in sequences} | {row for seq in sequences for _, row in seq.snapshots})
    torch.testing.assert_close(state[written], want_state[written], atol=2e-5, rtol=1e-4)
    untouched = [row for row in range(16) if row not in written]
    assert state[untouched].isnan().all()


def test_a_bf16_state_is_read_widened_and_written_rounded():
    """The same launch over a bf16 state and over its values in fp32 (no snapshots): the same outputs, bit for bit,
    and every slot written the fp32 one rounded (once per launch, not per token or chunk)."""
    kernels = _kernels()
    sequences, start, state = _requests("mixed", torch.bfloat16)
    sequences = [seq._replace(snapshots=()) for seq in sequences]
    wide = state.float()
    q, k, v, g, beta = _inputs(start, seed=8)
    out = kernels.rule_prefill_(state, q, k, v, g, beta, sequences)
    assert torch.equal(out, kernels.rule_prefill_(wide, q, k, v, g, beta, sequences))
    written = sorted(seq.slot for seq in sequences)
    assert torch.equal(state[written].view(torch.int16), wide[written].to(torch.bfloat16).view(torch.int16))
    assert state[[row for row in range(16) if row not in written]].isnan().all()


@pytest.mark.parametrize("case", LAYOUTS)
def test_a_bf16_state_goes_on_from_each_rounded_snapshot(case):
    """Past a snapshot a request goes on from the row as written (rounded), as one resumed from it would: the
    launch equals each request's pieces between its snapshots launched one by one, bit for bit (a verify step's
    accepted drafts then continue as decode steps would have)."""
    kernels = _kernels()
    sequences, start, state = _requests(case, torch.bfloat16)
    pieces_state = state.clone()
    q, k, v, g, beta = _inputs(start, seed=8)
    out = kernels.rule_prefill_(state, q, k, v, g, beta, sequences)
    pieces_out = torch.zeros_like(out)
    for seq in sequences:
        lo = 0
        for end, row in (*seq.snapshots, (seq.length, None)):
            if end > lo:
                piece = PrefillSequence(seq.start + lo, end - lo, seq.slot, seq.fresh and lo == 0,
                                        ((end - lo, row),) if row is not None else ())
                pieces_out += kernels.rule_prefill_(pieces_state, q, k, v, g, beta, [piece])
            lo = end
    assert torch.equal(out, pieces_out)
    assert torch.equal(state.view(torch.int16), pieces_state.view(torch.int16))  # NaN rows: the same bits


def test_the_chunk_table_cuts_at_snapshots_then_every_chunk():
    kernels = _kernels()
    sequences = [PrefillSequence(0, 150, 4, True, ((10, 7), (150, 8))), PrefillSequence(150, 3, 2, False, ())]
    slots, fresh, firsts, starts, lengths, rows = kernels.chunk_table(sequences)
    assert (slots, fresh, firsts) == ([4, 2], [1, 0], [0, 4, 5])
    assert starts == [0, 10, 74, 138, 150] and lengths == [10, 64, 64, 12, 3]
    assert rows == [7, -1, -1, 8, -1]
    for snapshots in (((0, 7),), ((5, 7), (5, 8)), ((9, 7), (4, 8)), ((151, 7),)):
        with pytest.raises(ValueError, match="snapshot boundaries"):
            kernels.chunk_table([PrefillSequence(0, 150, 4, True, snapshots)])


def test_inputs_the_kernel_would_not_take_are_refused():
    kernels = _kernels()
    q, k, v, g, beta = _inputs(3, seed=1)
    state = torch.zeros(2, V_HEADS, DK, DV, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernels.rule_prefill_(state, q.double(), k, v, g, beta, [PrefillSequence(0, 3, 0, True)])


def _layer(seed: int):
    from tests.layers.tiny_delta import tiny_gated_delta_net

    layer = tiny_gated_delta_net(seed)
    shapes = layer.state_shapes()
    layer.bind_state(torch.full((12, *shapes.conv_state), float("nan"), dtype=shapes.conv_dtype),
                     torch.full((12, *shapes.recurrent_state), float("nan")))
    return layer.to(DEVICE)


def test_a_layer_on_the_batched_prefill_equals_its_requests_one_at_a_time():
    """Two steps of a GatedDeltaNet on the Triton table (prefill kernel and the packed conv) against the same layer
    on torch's ops: fresh prompts of 70 and 3 tokens with a decode between them (their rows not one range), then a
    continuation of 5 tokens and one of 2, snapshot rows inside, at the end of and before a step's conv window."""
    from pagellm.kernels.attention_metadata import AttentionMetadata
    from pagellm.kernels.ops import REFERENCE, triton_ops

    import dataclasses

    reference, ours = _layer(0), _layer(0)
    reference.use_ops(REFERENCE)
    table = under_interpreter(triton_ops)
    launches = []

    def counted(*args):
        launches.append(len(args[-1]))  # the requests of one launch
        return table.gated_delta_prefill(*args)

    ours.use_ops(dataclasses.replace(table, gated_delta_prefill=counted))
    for layer in (reference, ours):  # slot 1 holds a request that decodes in the first step
        layer.conv_state[1].normal_(generator=torch.Generator().manual_seed(3))
        layer.recurrent_state[1].normal_(generator=torch.Generator().manual_seed(4))
    x = torch.randn(81, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    steps = [  # (query lens, seq lens, slots, snapshot writes (request, position, row))
        ([70, 1, 3], [70, 9, 3], [0, 1, 2], ((0, 2, 4), (0, 64, 5), (0, 70, 6), (2, 1, 7))),
        ([5, 2], [75, 5], [0, 2], ((0, 72, 8), (1, 4, 9))),
    ]
    fed = 0
    for query_lens, seq_lens, slots, writes in steps:
        meta = AttentionMetadata.build(query_lens, seq_lens, [[0]] * len(slots), 1024, torch.device(DEVICE), slots,
                                       writes)
        tokens = x[fed:fed + sum(query_lens)]
        fed += sum(query_lens)
        with torch.inference_mode():
            want, got = reference(tokens, meta), ours(tokens, meta)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert launches == [2, 2]  # each step's prefill requests in one launch
    written = [0, 1, 2, 4, 5, 6, 7, 8, 9]
    torch.testing.assert_close(ours.conv_state[written], reference.conv_state[written], atol=0, rtol=0)
    torch.testing.assert_close(ours.recurrent_state[written], reference.recurrent_state[written], atol=1e-5,
                               rtol=1e-4)
    assert ours.recurrent_state[[3, 10, 11]].isnan().all() and ours.conv_state[[3, 10, 11]].isnan().all()
