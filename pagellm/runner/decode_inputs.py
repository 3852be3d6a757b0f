"""Persistent input buffers for pure-decode steps, reused while the batch layout holds.

The seeds' graph-reuse idea on our eager path: a steady decode step feeds the
same requests in the same rows as the previous one, so instead of rebuilding
every input tensor from host lists, the step is prepared by diff:

    positions, seq_lens  += 1                      (in place)
    block_tables[row, n:] = appended block ids      (only rows that got a block)
    slot_mapping          = table[pos // bs] * bs + pos % bs   (computed on the device)
    input_ids             = the tokens sampled last step (one B-long copy)

A step is "reused" when it is pure decode and its slot order equals the
previous decode step's; anything else (an arrival, a finish, a prefill chunk)
rebuilds the layout. The buffers are allocated once at their largest size and
steps use views of their first rows.

Buckets (the shapes CUDA graphs are captured at, issue 31): with `buckets`
given, a step of B requests runs B' rows, B' the smallest bucket >= B (no
bucket that large, or a model with recurrent state: B rows). The padded rows
feed token 0 at position 0 with a context of one token in `scratch_block`, a KV
block beyond the pool that no request owns: they write and read only there,
and only the first B rows' logits are computed. The block table's width is
then fixed (a captured graph holds its address). Without buckets rows are not
padded: on CPU eager each padded row costs a full row of compute.
"""

from __future__ import annotations

import dataclasses

import torch

from pagellm.core.types import ScheduledRequest
from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.transfers import copy_to_device
from pagellm.runner.input_batch import SlotState


class DecodeInputs:
    def __init__(self, max_num_seqs: int, block_size: int, device: torch.device, buckets: tuple[int, ...] = (),
                 scratch_block: int | None = None, max_blocks: int | None = None, pad_state_slots: bool = False):
        """buckets: the batch sizes steps are padded to (ascending; empty: none), with `scratch_block` the padded
        rows' KV block and `max_blocks` the fixed table width (a request's most blocks). pad_state_slots: a model
        with recurrent state whose decode kernels skip a negative slot: its steps are padded too, their padded
        rows at slot -1 (else such a model's steps run unpadded)."""
        if buckets and (scratch_block is None or max_blocks is None or list(buckets) != sorted(set(buckets))
                        or buckets[0] < 1):
            raise ValueError(f"buckets {buckets} must ascend from 1 or more, with a scratch block and a table width")
        self.block_size, self.device = block_size, device
        self.buckets, self.scratch_block, self.pad_state_slots = tuple(buckets), scratch_block, pad_state_slots
        rows = max(max_num_seqs, *self.buckets) if buckets else max_num_seqs
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.state_slots = torch.zeros(rows, dtype=torch.int64, device=device)
        # widened on demand, or fixed at a request's most blocks when padding to buckets
        self.block_tables = torch.zeros(rows, max_blocks or 16, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)  # a padded step's, kept in place
        self._layout: tuple[int, ...] = ()  # slots of the previous decode step, row by row
        self._table_lens: list[int] = []  # block ids already written to each row's table
        self._seq_lens_host: tuple[int, ...] = ()
        self.hits = 0
        self.misses = 0
        self.padded = 0  # steps run at a bucket larger than their batch

    def rows_for(self, num_seqs: int, stateful: bool) -> int:
        """The rows a step of `num_seqs` requests runs: its bucket, or itself (no bucket fits, no buckets, or a
        model with recurrent state whose kernels would read a padded row's slot)."""
        if not stateful or self.pad_state_slots:
            for bucket in self.buckets:
                if bucket >= num_seqs:
                    return bucket
        return num_seqs

    def invalidate(self) -> None:
        """The next decode step rebuilds (the runner saw a step that was not pure decode)."""
        self._layout = ()

    def prepare(self, items: tuple[ScheduledRequest, ...], states: list[SlotState]):
        """Inputs of a pure-decode step: (input_ids, positions, meta, logits_rows, reused)."""
        num_seqs = len(items)
        layout = tuple(item.slot for item in items)
        state_slots_host = state_slots_of(items)
        seq_lens_host = tuple(item.start_position + 1 for item in items)
        # a table may hold blocks past its sequence: those a verify step took for its drafts (kept for the tokens
        # to come, core/scheduler.py)
        self._ensure_width(max(len(state.block_ids) for state in states))
        rows_run = self.rows_for(num_seqs, state_slots_host is not None)
        self.padded += rows_run > num_seqs
        # Same rows, each one token further: anything else (e.g. a slot handed to another request
        # that happens to sit in the same row) rebuilds.
        reused = layout == self._layout and all(
            new == old + 1 for new, old in zip(seq_lens_host, self._seq_lens_host))
        self._seq_lens_host = seq_lens_host
        if reused:
            self._advance(states)
            self.hits += 1
        else:
            self._rebuild(items, states, layout, state_slots_host)
            self._pad(num_seqs, rows_run)  # a reused step's padded rows are as this wrote them
            self.misses += 1
        copy_to_device(self.input_ids[:num_seqs], [item.token_ids[0] for item in items])
        if state_slots_host is not None:
            state_slots_host += (-1,) * (rows_run - num_seqs)  # padded rows: no slot (the kernels skip them)
        meta = self._step_meta(rows_run, seq_lens_host + (1,) * (rows_run - num_seqs), state_slots_host)
        logits_rows = self.query_start_loc[:num_seqs]  # every request's row samples; padded rows never do
        return self.input_ids[:rows_run], self.positions[:rows_run], meta, logits_rows, reused

    def graph_keys(self) -> tuple[int, ...]:
        """The shapes graphs are captured at: the buckets."""
        return self.buckets

    def capture_inputs(self, bucket: int):
        """(input_ids, positions, meta) of a step whose `bucket` rows are all padding: what a graph is captured
        over (the buffers' addresses, as every later step of that bucket fills them). The next step rebuilds."""
        self.invalidate()
        self._pad(0, bucket)
        slots = (-1,) * bucket if self.pad_state_slots else None
        meta = dataclasses.replace(self._step_meta(bucket, (1,) * bucket, slots), for_graph=True)
        return self.input_ids[:bucket], self.positions[:bucket], meta

    def _step_meta(self, rows_run: int, seq_lens_host: tuple[int, ...], state_slots_host) -> AttentionMetadata:
        """The metadata of the first `rows_run` rows as the buffers hold them, slot_mapping computed on the device."""
        rows = slice(0, rows_run)
        positions = self.positions[rows]
        # a padded step reads the whole fixed-width table (one shape per bucket); else the widest row's blocks
        width = self.block_tables.shape[1] if self.buckets else -(-max(seq_lens_host) // self.block_size)
        tables = self.block_tables[rows, :width]
        block = tables.gather(1, (positions // self.block_size)[:, None]).squeeze(1)
        slots = block * self.block_size + positions % self.block_size
        if self.buckets:  # every input a captured graph reads lives at a fixed address
            slots = self.slot_mapping[rows].copy_(slots)
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self.query_start_loc[: rows_run + 1],
            seq_lens=self.seq_lens[rows],
            block_tables=tables,
            block_size=self.block_size,
            query_start_loc_host=tuple(range(rows_run + 1)),
            seq_lens_host=seq_lens_host,
            state_slots=None if state_slots_host is None else self.state_slots[rows],
            state_slots_host=state_slots_host,
        )

    def _pad(self, num_seqs: int, rows_run: int) -> None:
        """Rows num_seqs .. rows_run: token 0 at position 0 over one token of the scratch block."""
        if rows_run > num_seqs:
            pad = slice(num_seqs, rows_run)
            self.input_ids[pad] = 0
            self.positions[pad] = 0
            self.seq_lens[pad] = 1
            self.block_tables[pad] = 0
            self.block_tables[pad, 0] = self.scratch_block
            self.state_slots[pad] = -1

    def _ensure_width(self, num_blocks: int) -> None:
        width = self.block_tables.shape[1]
        if num_blocks > width and self.buckets:  # the scheduler never lets a request past max_model_len
            raise ValueError(f"a request of {num_blocks} blocks exceeds the fixed table width {width}")
        if num_blocks > width:  # doubling: a run widens O(log context) times
            wider = torch.zeros(self.block_tables.shape[0], max(num_blocks, 2 * width),
                                dtype=torch.int64, device=self.device)
            wider[:, :width] = self.block_tables
            self.block_tables = wider

    def _advance(self, states: list[SlotState]) -> None:
        num_seqs = len(states)
        self.positions[:num_seqs].add_(1)
        self.seq_lens[:num_seqs].add_(1)
        for row, state in enumerate(states):
            written = self._table_lens[row]
            if len(state.block_ids) > written:  # a block was appended: write only the new ids
                new_ids = state.block_ids[written:]
                copy_to_device(self.block_tables[row, written : written + len(new_ids)], new_ids)
                self._table_lens[row] = len(state.block_ids)

    def _rebuild(self, items, states: list[SlotState], layout: tuple[int, ...], state_slots_host) -> None:
        num_seqs = len(items)
        positions = [item.start_position for item in items]
        width = max(len(s.block_ids) for s in states)
        table = torch.zeros(num_seqs, width, dtype=torch.int64)
        for row, state in enumerate(states):
            table[row, : len(state.block_ids)] = torch.tensor(state.block_ids)
        copy_to_device(self.positions[:num_seqs], positions)
        copy_to_device(self.seq_lens[:num_seqs], [p + 1 for p in positions])
        if state_slots_host is not None:
            copy_to_device(self.state_slots[:num_seqs], state_slots_host)
        copy_to_device(self.block_tables[:num_seqs, :width], table)
        self._table_lens = [len(s.block_ids) for s in states]
        self._layout = layout


def state_slots_of(items: tuple[ScheduledRequest, ...]) -> tuple[int, ...] | None:
    """Recurrent-state slots of the step's requests; None for a model without recurrent state."""
    if not items or items[0].state_slot is None:
        return None
    return tuple(item.state_slot for item in items)
