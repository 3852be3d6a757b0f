"""Speculative decoding's method mtp: the checkpoint's multi-token-prediction head (models/mtp.py) proposes each
speculating request's next tokens from the model's own last hidden states.

Every step's forward leaves its hidden rows here (record). Before the next step is scheduled, propose() runs the
head over every running request's rows whose next token is known on the host (the row at position p and token
p + 1: a prefill chunk's, its last row once the token after it is; a decode's one; a verify step's accepted
ones), which writes the head's KV at those positions in the request's own blocks, as vLLM's drafter does for
every request every step: a request that speculates later has its context whole. A request the scheduler lets
speculate then gets its first draft from its last row's logits, and each further one from one more pass of the
head over the draft before, its hidden input the head's own output. Those passes write the head's KV in the
request's last block where it has room (the next catch-up writes over it) and past it in scratch blocks after
the cache's (the next round's). Drafts are greedy (one-hot), so the target's verification keeps its exact
distribution (runner/speculative.py).

A prefix-cache hit reads the head's KV the cached blocks' first request wrote; a block's last position was
written from that request's next token, which a later request may not share: only the drafts can differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch

from pagellm.core.types import ScheduledRequest
from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.transfers import to_device
from pagellm.models.bound_layers import plan_backbone


class Request(Protocol):
    """What the drafter reads of the engine's requests (pagellm/request.py's, on this process: one rank)."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    all_token_ids: list[int]


def scratch_blocks_per_request(num_speculative_tokens: int, block_size: int) -> int:
    """Blocks past a request's computed ones that its drafts 2..k write the head's KV to."""
    return -(-(num_speculative_tokens - 1) // block_size)


def mtp_scratch_blocks(config) -> int:
    """Scratch blocks the KV cache gets past its own (EngineConfig): a share for each request that may draft at
    once (no more than disable_by_batch_size decodes speculate)."""
    spec = config.speculative
    if spec is None or spec.method != "mtp":
        return 0
    per_request = scratch_blocks_per_request(spec.num_speculative_tokens, config.cache.block_size)
    return per_request * min(spec.disable_by_batch_size, config.scheduler.max_num_seqs)


class MtpDrafter:
    def __init__(self, model, compute_logits, block_size: int, device: torch.device, scratch: range,
                 num_speculative_tokens: int):
        """scratch: block ids past the cache's (bound with it, never handed out by the block pool)."""
        self.head, self.backbone = model.mtp, model.model
        self.compute_logits = compute_logits
        self.block_size, self.device = block_size, device
        self.per_request = scratch_blocks_per_request(num_speculative_tokens, block_size)
        self.scratch = scratch
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (first position, hidden rows [n, E])
        self.plan = None  # the head's layer bound to the kernels (replan), else its modules run

    def replan(self, settings) -> str:
        """Bind the head's layer as the model's are bound (PlanSettings), where it can be; returns how it runs,
        in words."""
        backbone = type(self.backbone)
        self.plan, why = plan_backbone(self.head, backbone.norms_of, settings, layer_class=backbone.bound_layer)
        return "MTP head bound to the kernels" if self.plan is not None else f"MTP head: modules ({why})"

    def record(self, items: Sequence[ScheduledRequest], hidden: torch.Tensor, offsets: Sequence[int]) -> None:
        """After a step's forward: each item's hidden rows [n, E] (copied out once: a graph's output is reused),
        after its rows kept from before (a position fed again, a rejected draft's or a recomputed one's,
        replaces them and those after it)."""
        index = [offset + i for item, offset in zip(items, offsets) for i in range(len(item.token_ids))]
        rows = hidden.index_select(0, to_device(index, torch.int64, hidden.device))  # [sum n, E]
        start = 0
        for item in items:
            n, position = len(item.token_ids), item.start_position
            new = rows[start : start + n]
            start += n
            first, kept = self._rows.get(item.request_id, (position, new[:0]))
            if first < position <= first + len(kept):
                new = torch.cat([kept[: position - first], new])
            else:
                first = position
            self._rows[item.request_id] = (first, new)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, wanted: Sequence[tuple[Request, int]], running: Iterable[Request],
                tables: Mapping[str, list[int]]) -> dict[str, tuple[int, ...]]:
        """{request id: its greedy drafts} for each (request, k) of `wanted`, after the head caught up on every
        running request (tables: each one's block ids)."""
        running = [request for request in running if request.request_id in tables]
        self.forget(set(self._rows) - {request.request_id for request in running})
        batch = self._catch_up_batch(running)
        if not batch:
            return {}
        requests, tokens, firsts, ends, rows = zip(*batch)
        out = self._run(list(tokens), list(firsts), list(ends), [tables[r.request_id] for r in requests],
                        torch.cat(rows))  # [T, E]
        lengths = {request.request_id: k for request, k in wanted}
        last_rows = list(itertools.accumulate(end - first for first, end in zip(firsts, ends)))
        # a request drafts from the row of its last computed position (the one whose logits gave its last token)
        drafting = [(request, last - 1, lengths[request.request_id])
                    for request, end, last in zip(requests, ends, last_rows)
                    if request.request_id in lengths and end == request.num_tokens - 1]
        return self._draft(drafting, out, tables)

    def _catch_up_batch(self, running: list[Request]) -> list:
        """(request, tokens, first position, end position, hidden rows) of the rows whose next token is known."""
        batch = []
        for request in running:
            entry = self._rows.get(request.request_id)
            if entry is None:
                continue
            first, rows = entry
            end = min(request.num_computed_tokens, len(request.all_token_ids) - 1, first + len(rows))
            if end <= first:
                continue
            tokens = request.all_token_ids[first + 1 : end + 1]  # row p predicts from token p + 1
            batch.append((request, tokens, first, end, rows[: end - first]))
            # a copy of what waits (a chunk's last row, rows of a step in flight): not a view keeping the step's
            self._rows[request.request_id] = (end, rows[end - first :].clone())
        return batch

    def _run(self, tokens: list[list[int]], firsts: list[int], ends: list[int], tables: list[list[int]],
             hidden: torch.Tensor) -> torch.Tensor:
        """One pass of the head over each request's tokens at positions first .. end - 1: [T, E]."""
        flat = [t for piece in tokens for t in piece]
        positions = to_device([p for first, end in zip(firsts, ends) for p in range(first, end)], torch.int64,
                              self.device)
        meta = AttentionMetadata.build([end - first for first, end in zip(firsts, ends)], ends, tables,
                                       self.block_size, self.device)
        embedded = self.backbone.embed_tokens(to_device(flat, torch.int64, self.device))  # [T, E]
        cos, sin = self.backbone.rotary_emb(positions, embedded.dtype)
        return self.head(embedded, hidden.to(embedded.dtype), cos, sin, meta, self.plan)

    def _draft(self, drafting: list[tuple[Request, int, int]], out: torch.Tensor,
               tables: Mapping[str, list[int]]) -> dict[str, tuple[int, ...]]:
        """drafting: (request, its last caught-up row in `out`, k): the first draft from that row, each further
        one from a pass of the head over the one before (past the scratch blocks' share, one draft)."""
        if not drafting:
            return {}
        capacity = len(self.scratch) // self.per_request if self.per_request else len(drafting)
        lengths = [k if i < capacity else 1 for i, (_, _, k) in enumerate(drafting)]
        hidden = out[[row for _, row, _ in drafting]]  # [R, E]
        drafts = [[t] for t in self.compute_logits(hidden).argmax(dim=-1).tolist()]
        active = list(range(len(drafting)))  # hidden's rows: these drafting requests'
        for step in range(1, max(lengths)):
            keep = [j for j, i in enumerate(active) if lengths[i] > step]
            active, hidden = [active[j] for j in keep], hidden[keep]
            requests = [drafting[i][0] for i in active]
            positions = [request.num_tokens - 2 + step for request in requests]  # where the draft before goes
            hidden = self._run([[drafts[i][-1]] for i in active], positions, [p + 1 for p in positions],
                               [self._draft_table(drafting[i][0], tables[drafting[i][0].request_id], i)
                                for i in active], hidden)  # [R', E]
            for i, token in zip(active, self.compute_logits(hidden).argmax(dim=-1).tolist()):
                drafts[i].append(token)
        return {request.request_id: tuple(d) for (request, _, _), d in zip(drafting, drafts)}

    def _draft_table(self, request: Request, table: list[int], share: int) -> list[int]:
        """The request's blocks up to its last computed position's, then its share of the scratch blocks."""
        own = table[: (request.num_tokens - 2) // self.block_size + 1]
        first = share * self.per_request
        return own + list(self.scratch[first : first + self.per_request])
