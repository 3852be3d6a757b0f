"""AttentionMetadata: everything attention needs about one step, built once per step.

A step packs the scheduled tokens of B requests back to back (T tokens in all).
Request b owns rows query_start_loc[b] : query_start_loc[b+1] of every [T, ...]
tensor; its context after this step is seq_lens[b] tokens, stored in the KV
blocks block_tables[b, :ceil(seq_lens[b] / block_size)].

    KV cache of one layer: [num_blocks, block_size, H_kv, D]
    logical token j of request b  ->  block block_tables[b, j // block_size],
                                      row   j % block_size

The host-side lists mirror the tensors so that a Python-level kernel never has
to read a device tensor back (no hidden host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.kernels.transfers import to_device


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int64, context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int64, physical block ids, padded with 0
    block_size: int
    query_start_loc_host: tuple[int, ...]  # same as query_start_loc, on the host
    seq_lens_host: tuple[int, ...]  # same as seq_lens, on the host
    # Hybrid models: request b's recurrent state lives in slot state_slots[b] of each
    # linear-attention layer's state tensors; None for models without recurrent state.
    state_slots: torch.Tensor | None = None  # [B] int64
    state_slots_host: tuple[int, ...] | None = None
    # Hybrid models with prefix caching: (b, p, row) = copy request b's state after its first p
    # tokens (a block boundary inside this step's chunk) into state row `row` (a snapshot row).
    snapshot_writes: tuple[tuple[int, int, int], ...] = ()
    # Hybrid models' verify steps replayed from graphs (runner/verify_inputs.py), every request's Q tokens at rows
    # b Q + j: verify_slots[j, b] its state slot where token j is real (-1: padding), verify_rows[j, b] the row the
    # state after that token is copied to (a draft's rollback row; -1: none). [Q, B] int64 each, on the device.
    verify_slots: torch.Tensor | None = None
    verify_rows: torch.Tensor | None = None
    # Built for a CUDA graph's capture: its replays run the kernels' launch choices for other contexts, so the
    # kernels make them from shapes alone (kernels/gpu/attention.py), not from the host values above.
    for_graph: bool = False

    @property
    def query_lens_host(self) -> tuple[int, ...]:
        starts = self.query_start_loc_host
        return tuple(hi - lo for lo, hi in zip(starts, starts[1:]))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        """Every request feeds exactly one token (the common steady-state step)."""
        return self.query_start_loc_host[-1] == self.num_seqs

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        state_slots: list[int] | None = None,
        snapshot_writes: tuple[tuple[int, int, int], ...] = (),
    ) -> "AttentionMetadata":
        """Build from per-request host lists (query length, context length, block ids, state slot)."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        slots: list[int] = []
        for qlen, slen, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(slen - qlen, slen):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        device = torch.device(device)
        return cls(
            slot_mapping=to_device(slots, torch.int64, device),
            query_start_loc=to_device(starts, torch.int64, device),
            seq_lens=to_device(seq_lens, torch.int64, device),
            block_tables=to_device(padded, torch.int64, device).reshape(len(padded), width),
            block_size=block_size,
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(seq_lens),
            state_slots=None if state_slots is None else to_device(state_slots, torch.int64, device),
            state_slots_host=None if state_slots is None else tuple(state_slots),
            snapshot_writes=tuple(snapshot_writes),
        )

    def snapshot_writes_by_request(self) -> dict[int, list[tuple[int, int]]]:
        """Request b -> its snapshot writes as (p, row) pairs, ascending in p; empty without any."""
        grouped: dict[int, list[tuple[int, int]]] = {}
        for b, p, row in sorted(self.snapshot_writes):
            grouped.setdefault(b, []).append((p, row))
        return grouped
