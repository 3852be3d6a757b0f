"""Persistent input buffers for verify steps (speculative decoding), the shapes their CUDA graphs are captured at.

A verify step feeds each request its decode token and k_i drafts (core/scheduler.py); at B=1 on a GPU it is bound
by the host as a decode step is, so it is replayed from a graph like one (runner/decode_graphs.py). A graph holds
one shape, so every request's tokens are padded to one query length Q = 1 + K, K the smallest draft bucket that
holds the step's most drafts, and the rows to a batch bucket (vLLM's uniform-decode graphs for speculation):

    row b (a request)  its 1 + k_b tokens, then token 0 up to Q, at the positions after them; the table's entries
                       past the request's blocks point at the scratch block
    padded rows        token 0 at positions 0 .. Q-1, every table entry the scratch block

A padding token writes its K/V where its position falls: into the request's own blocks past its drafts (what a
rejected draft leaves there too: the next steps overwrite it before the prefix cache can hash it), or into the
scratch block, which no request owns. A real token attends only to positions at or before its own (causal), all
real; every key a tile loads was written by this step or earlier ones, so a padded row's values never reach a real
row. Only the real tokens' logits are computed.

Models with recurrent state (`recurrent`) replay them where the device's Gated DeltaNet decode kernels skip padded
slots: each layer runs token j of every request as a decode step at the slots of verify_slots[j], where a padding
token's slot is -1 (it advances no state), and copies the state after it to the request's rollback row for that
draft (verify_rows[j]); elsewhere they verify eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from pagellm.core.types import ScheduledRequest
from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.transfers import copy_to_device, to_device
from pagellm.runner.input_batch import SlotState


def draft_buckets(num_speculative_tokens: int) -> tuple[int, ...]:
    """The draft lengths K graphs are captured at: powers of two below num_speculative_tokens, and it (a verify of
    k drafts pads to at most twice its tokens)."""
    sizes = {num_speculative_tokens} | {1 << i for i in range(7) if 1 << i < num_speculative_tokens}
    return tuple(sorted(sizes))


class VerifyInputs:
    def __init__(self, row_buckets: tuple[int, ...], drafts: tuple[int, ...], block_size: int, device: torch.device,
                 scratch_block: int, max_blocks: int, max_model_len: int, recurrent: bool = False):
        """row_buckets: the batch sizes verify steps are padded to (ascending); drafts: the draft lengths K
        (ascending); scratch_block: the padding's KV block; max_blocks: the fixed table width; recurrent: the model
        keeps Gated DeltaNet state in slots (its kernels skip padded slots)."""
        if not row_buckets or not drafts or list(row_buckets) != sorted(set(row_buckets)) or row_buckets[0] < 1 \
                or list(drafts) != sorted(set(drafts)) or drafts[0] < 1:
            raise ValueError(f"row buckets {row_buckets} and draft buckets {drafts} must ascend from 1 or more")
        self.row_buckets, self.drafts, self.block_size, self.device = row_buckets, drafts, block_size, device
        self.scratch_block, self.max_model_len = scratch_block, max_model_len
        rows, tokens = row_buckets[-1], row_buckets[-1] * (1 + drafts[-1])
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int64, device=device)
        self.query_start_locs = {(r, k): torch.arange(0, r * (1 + k) + 1, 1 + k, dtype=torch.int64, device=device)
                                 for r, k in self.graph_keys()}  # one per shape: a graph holds its address
        self.recurrent = recurrent
        # [Q, rows] each (module docstring); row j of a shape's view is contiguous, as the kernels take it
        self.verify_slots = torch.full((1 + drafts[-1], rows), -1, dtype=torch.int64, device=device)
        self.verify_rows = torch.full((1 + drafts[-1], rows), -1, dtype=torch.int64, device=device)
        self.padded_tokens = 0  # padding tokens run, over all verify steps prepared here

    def graph_keys(self) -> list[tuple[int, int]]:
        """(rows, drafts) of every shape."""
        return [(r, k) for r in self.row_buckets for k in self.drafts]

    def key_for(self, items: tuple[ScheduledRequest, ...]) -> tuple[int, int] | None:
        """The shape a step of verify items and plain decodes pads to, or None: it runs eagerly (recurrent state
        where its kernels would not skip padding, no bucket that large, or padding that would pass max_model_len)."""
        if any(item.state_slot is not None for item in items) and not self.recurrent:
            return None
        if any(item.snapshot_writes for item in items):  # prefix-cache snapshots: the eager step writes those
            return None
        most = max(item.num_draft for item in items)
        rows = next((b for b in self.row_buckets if b >= len(items)), None)
        drafts = next((k for k in self.drafts if k >= most), None)
        if rows is None or drafts is None or any(item.start_position + 1 + drafts > self.max_model_len
                                                 for item in items):
            return None
        return rows, drafts

    def invalidate(self) -> None:
        """Nothing is kept between steps (every verify step is written whole)."""

    def prepare(self, items: tuple[ScheduledRequest, ...], states: list[SlotState], key: tuple[int, int]):
        """Inputs of a verify step of shape `key`: (input_ids, positions, meta, logits_rows, offsets), offsets[b]
        the first token row of request b."""
        rows, drafts = key
        q = 1 + drafts
        tokens, positions, tables, seq_lens = [], [], [], []
        for item, state in zip(items, states):
            tokens += [*item.token_ids, *(0,) * (q - len(item.token_ids))]
            positions += range(item.start_position, item.start_position + q)
            tables.append(state.block_ids)
            seq_lens.append(item.start_position + q)
        self.padded_tokens += rows * q - sum(len(item.token_ids) for item in items)
        logits_rows = [b * q + i for b, item in enumerate(items) if item.sample for i in range(1 + item.num_draft)]
        self._fill(tokens, positions, tables, seq_lens, rows, q)
        slots = self._fill_state(items, rows, q)
        meta = self._meta(rows, q, tuple(seq_lens) + (q,) * (rows - len(items)), slots)
        return (self.input_ids[: rows * q], self.positions[: rows * q], meta,
                to_device(logits_rows, torch.int64, self.device), [b * q for b in range(len(items))])

    def capture_inputs(self, key: tuple[int, int]):
        """(input_ids, positions, meta) of a step of shape `key` whose rows are all padding, for a capture."""
        rows, drafts = key
        q = 1 + drafts
        self._fill([], [], [], [], rows, q)
        meta = self._meta(rows, q, (q,) * rows, self._fill_state((), rows, q))
        return self.input_ids[: rows * q], self.positions[: rows * q], dataclasses.replace(meta, for_graph=True)

    def _fill_state(self, items: tuple[ScheduledRequest, ...], rows: int, q: int) -> tuple[int, ...] | None:
        """A recurrent model's per-token slots and rollback rows (padding: -1); returns each row's slot."""
        if not self.recurrent:
            return None
        slots = [[-1] * rows for _ in range(q)]
        targets = [[-1] * rows for _ in range(q)]
        for b, item in enumerate(items):
            for j in range(len(item.token_ids)):
                slots[j][b] = item.state_slot
            for j, row in enumerate(item.draft_state_rows):  # the state after token j: draft j's rollback point
                targets[j][b] = row
        copy_to_device(self.verify_slots[:q, :rows], slots)
        copy_to_device(self.verify_rows[:q, :rows], targets)
        return tuple(slots[0])

    def _fill(self, tokens: list[int], positions: list[int], tables: list[list[int]], seq_lens: list[int],
              rows: int, q: int) -> None:
        """The buffers' first rows: the requests', then padded rows up to `rows`."""
        width, scratch, bs = self.block_tables.shape[1], self.scratch_block, self.block_size
        padded = rows - len(tables)
        tokens = tokens + [0] * (padded * q)
        positions = positions + [*range(q)] * padded
        table = [[*blocks, *(scratch,) * (width - len(blocks))] for blocks in tables] + [[scratch] * width] * padded
        slots = [table[t // q][p // bs] * bs + p % bs for t, p in enumerate(positions)]
        copy_to_device(self.input_ids[: rows * q], tokens)
        copy_to_device(self.positions[: rows * q], positions)
        copy_to_device(self.slot_mapping[: rows * q], slots)
        copy_to_device(self.seq_lens[:rows], seq_lens + [q] * padded)
        copy_to_device(self.block_tables[:rows], table)

    def _meta(self, rows: int, q: int, seq_lens_host: tuple[int, ...],
              state_slots: tuple[int, ...] | None) -> AttentionMetadata:
        recurrent = state_slots is not None
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: rows * q],
            query_start_loc=self.query_start_locs[(rows, q - 1)],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            block_size=self.block_size,
            query_start_loc_host=tuple(range(0, rows * q + 1, q)),
            seq_lens_host=seq_lens_host,
            state_slots=self.verify_slots[0, :rows] if recurrent else None,
            state_slots_host=state_slots,
            verify_slots=self.verify_slots[:q, :rows] if recurrent else None,
            verify_rows=self.verify_rows[:q, :rows] if recurrent else None,
        )
