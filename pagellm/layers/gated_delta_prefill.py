"""A step's prefill requests through a device's batched Gated DeltaNet prefill (LayerOps.gated_delta_prefill; on
CUDA kernels/gpu/gated_delta_prefill.py), for all of them at once.

Why: the module's own prefill (GatedDeltaNet._sequence) runs each request alone, a conv and tens of small ops a
request per layer; on a GPU a step of many prompts is then bound by launches. Here the causal conv of every
request is one depthwise conv over their tokens packed each behind its own K-1 inputs of history (so no window
reaches into another request), and the rule is one launch that reads and writes each state at its slot.

Legend as layers/gated_delta_net.py: T = the requests' tokens, C = conv channels, K = conv taps, P = T + N·(K-1)
for N requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.reference.gated_delta import PrefillSequence
from pagellm.kernels.transfers import to_device


def conv_prefill_(conv_state: torch.Tensor, weight: torch.Tensor, x: torch.Tensor,
                  sequences: list[PrefillSequence]) -> torch.Tensor:
    """x [T, C] the requests' pre-conv inputs, packed -> silu(causal depthwise conv) [T, C] in x's dtype, rounded
    as the module's conv1d. Each request's slot of conv_state [S, C, K-1] is left holding its last K-1 inputs, and
    each snapshot row the K-1 inputs before its boundary. A fresh request's history is zeros (its slot unread)."""
    tokens, channels = x.shape
    history = weight.shape[-1] - 1
    continued = [seq.slot for seq in sequences if not seq.fresh]
    held = conv_state[to_device(continued, torch.long, x.device)] if continued else conv_state[:0]  # [n, C, K-1]
    source = torch.cat([x, held.transpose(1, 2).reshape(-1, channels).to(x.dtype), x.new_zeros(1, channels)])
    zero_row = source.shape[0] - 1
    packed, outputs, state_rows, targets = [], [], [], []
    held_row = tokens
    for seq in sequences:
        base = len(packed)  # packed row base + K-1 + j is the request's token j; conv column base + j ends there
        if seq.fresh:
            packed.extend([zero_row] * history)
        else:
            packed.extend(range(held_row, held_row + history))
            held_row += history
        packed.extend(range(seq.start, seq.start + seq.length))
        outputs.extend(range(base, base + seq.length))
        for end, row in (*seq.snapshots, (seq.length, seq.slot)):  # the K-1 inputs before token `end`
            state_rows.extend(range(base + end, base + end + history))
            targets.append(row)
    window = source[to_device(packed, torch.long, x.device)]  # [P, C]
    conv = F.conv1d(window.t()[None].to(weight.dtype), weight, groups=channels)[0]  # [C, P - (K-1)]
    out = F.silu(conv[:, to_device(outputs, torch.long, x.device)]).t().to(x.dtype)  # [T, C]
    states = window[to_device(state_rows, torch.long, x.device)].view(len(targets), history, channels)
    conv_state.index_copy_(0, to_device(targets, torch.long, x.device), states.transpose(1, 2).to(conv_state.dtype))
    return out


def packed_prefill(layer, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                   requests: list[int], writes: dict[int, list[tuple[int, int]]]):
    """The prefill of `requests` (indices into the step; each with tokens) of a GatedDeltaNet `layer`: mixed [T, C]
    pre-conv, g, beta [T, Hv] of the whole step -> (their token rows: a slice or an index tensor, the core output
    [n, Hv, dv] in mixed's dtype). writes: request -> its (position, snapshot row) pairs."""
    starts, slots = meta.query_start_loc_host, meta.state_slots_host
    sequences, rows = [], []
    for i in requests:
        lo, hi = starts[i], starts[i + 1]
        before = meta.seq_lens_host[i] - (hi - lo)  # context before the step; 0 = fresh
        snapshots = tuple((p - before, row) for p, row in writes.get(i, ()))
        sequences.append(PrefillSequence(len(rows), hi - lo, slots[i], before == 0, snapshots))
        rows.extend(range(lo, hi))
    contiguous = rows[-1] - rows[0] + 1 == len(rows)  # ascending and disjoint: no gap means one range
    index = slice(rows[0], rows[-1] + 1) if contiguous else to_device(rows, torch.long, mixed.device)
    conv_out = conv_prefill_(layer.conv_state, layer.conv1d.weight, mixed[index], sequences)
    q, k, v = layer.split_heads(conv_out, per_key_head=True)
    out = layer.ops.gated_delta_prefill(layer.recurrent_state, q, k, v, g[index].float().contiguous(),
                                        beta[index].float().contiguous(), sequences)
    return index, out.to(mixed.dtype)
