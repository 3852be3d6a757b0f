"""Scheduler: one rule — each request's num_computed_tokens catches up with its token count.

There is no prefill or decode phase. A decode is a running request that needs
one token; a prefill chunk is a request that needs many. Each step:

  1. running decodes claim their tokens first (D tokens);
  2. prefill (running chunks, then waiting requests in arrival order) shares a
     budget of max(n_ubatch, T - D), so a long prompt is chunked and never
     freezes the decodes batched with it;
  3. when blocks run out, the newest running request is preempted: its blocks
     are freed and it is recomputed later (mostly from the prefix cache).

A scheduled step's tokens count as computed at once, and each token it samples
is a placeholder until update() fills it: so a step can be scheduled while the
previous one still runs (async scheduling, engine.py), its decodes feeding the
previous step's tokens from the device. A request whose placeholders would
reach its max_tokens or max_model_len is not scheduled again: it is done.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from pagellm.config import SchedulerConfig, SpeculativeConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.speculative import Speculation
from pagellm.core.state_pool import StatePool
from pagellm.core.types import PLACEHOLDER, ModelOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from pagellm.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 state_pool: StatePool | None = None, speculative: SpeculativeConfig | None = None):
        """speculative: propose tokens for decodes (core/speculative.py); with a state pool each state slot then
        has num_speculative_tokens rollback rows after the slots and the snapshot rows (draft_state_rows)."""
        self.config = config
        self.kv_cache = kv_cache
        self.state_pool = state_pool  # hybrid models: one recurrent-state slot per running request
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self._released: list[str] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.held: frozenset[str] = frozenset()  # left out of steps while a failing request is isolated
        self.speculation = Speculation(speculative) if speculative is not None else None
        self._proposals: Mapping[str, tuple[int, ...]] = {}  # method draft_model: this step's

    # ---- public API -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError when it could never run."""
        # A prompt must leave room for one generated token and fit the whole KV pool.
        limit = min(self.max_model_len - 1, self.kv_cache.pool.num_blocks * self.kv_cache.block_size)
        if request.num_prompt_tokens > limit:
            raise ValueError(
                f"prompt is {request.num_prompt_tokens} tokens, longer than the {limit} tokens this engine can hold "
                f"(max_model_len {self.max_model_len}, KV pool {self.kv_cache.pool.num_blocks} blocks of "
                f"{self.kv_cache.block_size} tokens)"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def recover_failed_step(self, output: SchedulerOutput) -> None:
        """After a step that failed wherever it failed (the runner may or may not have taken its diff): its requests
        go back to waiting, to be recomputed from the prefix cache, which forgets the blocks the step never
        computed. Scheduler and runner then agree again whatever the step left behind."""
        self._settle_snapshots(output.scheduled, commit=False)
        self.kv_cache.forget(output.cached_blocks)  # aborted or preempted meanwhile too: nobody may read them
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:
                continue
            request.num_placeholders = 0  # the step never sampled (nor did a step scheduled after it)
            if request.status != RequestStatus.RUNNING:
                continue
            self._preempt(request)
            request.num_preemptions -= 1  # not a preemption for want of blocks
            self.num_preemptions -= 1

    def hold(self, request_ids) -> None:
        """Leave these requests out of the steps scheduled until hold(()) (isolating a failing request)."""
        self.held = frozenset(request_ids)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish or abort a request wherever it is; its blocks and slot return at once."""
        request = self.requests.pop(request_id, None)
        if self.speculation is not None:
            self.speculation.forget(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        else:
            self.waiting.remove(request)
        request.status = status
        return request

    def schedule(self, proposals: Mapping[str, tuple[int, ...]] | None = None) -> SchedulerOutput:
        """proposals (methods draft_model, mtp): each request's drafts, of the lengths draft_requests() asked for."""
        self.num_steps += 1
        self._proposals = proposals or {}
        scheduled: list[ScheduledRequest] = []
        num_decode = self._schedule_decodes(scheduled)
        prefill_budget = max(self.config.n_ubatch, self.config.max_num_batched_tokens - num_decode)
        interval = self.config.decode_stable_interval
        if interval and num_decode and self.num_steps % interval:
            prefill_budget = 0  # decode-stable mode: prefill only joins every K-th step
        used = self._schedule_running_prefills(scheduled, prefill_budget)
        self._schedule_waiting(scheduled, prefill_budget - used)
        released, self._released = tuple(self._released), []
        for item in scheduled:  # the step's tokens are computed as of its end; its samples are placeholders
            request = self.requests[item.request_id]
            request.num_computed_tokens += len(item.token_ids)
            request.num_placeholders += item.sample
        num_tokens = sum(len(item.token_ids) for item in scheduled)
        num_decode = sum(len(item.token_ids) for item in scheduled
                         if item.new is None and (len(item.token_ids) == 1 or item.num_draft))
        released_blocks, released_rows = self.kv_cache.take_released()
        return SchedulerOutput(tuple(scheduled), released, num_decode, num_tokens - num_decode,
                               self.kv_cache.take_registered(), released_blocks, released_rows)

    def update(self, output: SchedulerOutput, model_output: ModelOutput) -> list[tuple[Request, int]]:
        """Fill the step's placeholders with its sampled tokens; return each request that got tokens with how
        many (a request preempted while the step ran too: the tokens are its output). A verify step's tokens
        stop at the first that ends the request (stop id, max_tokens, max_model_len); its rejected drafts are
        no longer computed."""
        self._settle_snapshots(output.scheduled, commit=True)
        drafts = {item.request_id: item for item in output.scheduled if item.num_draft}
        updated: dict[str, tuple[Request, int]] = {}
        for request_id, token_id in zip(model_output.request_ids, model_output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished or aborted while the step ran
            got = updated.get(request_id, (request, 0))[1]
            if got == 0:
                if not request.num_placeholders:
                    continue  # its placeholder was dropped (preempted with the step running, then resumed)
                request.num_placeholders -= 1
            elif self.check_length_stop(request) is not None:
                continue  # an accepted draft after the token that ends it
            request.append_output_token(token_id)
            updated[request_id] = (request, got + 1)
        for request_id, item in drafts.items():
            self._settle_verify(item, updated.get(request_id, (None, 0))[1])
        return list(updated.values())

    def _settle_verify(self, item: ScheduledRequest, num_emitted: int) -> None:
        """A verify step's outcome: the rejected drafts' KV is no longer computed (the next step overwrites it;
        the blocks stay the request's, for the tokens to come), and a hybrid model's state goes back to the
        row after the accepted tokens. Counted for the acceptance figures and the request's draft length."""
        request = self.requests.get(item.request_id)
        accepted = max(num_emitted - 1, 0)
        running = request is not None and request.status == RequestStatus.RUNNING and \
            request.num_computed_tokens == item.start_position + len(item.token_ids)  # not preempted meanwhile
        self.speculation.record(item.request_id, item.num_draft, accepted, running)
        if not running:
            return  # finished, or preempted (recomputed from its tokens) while the step ran
        request.num_computed_tokens -= item.num_draft - accepted
        self.kv_cache.cache_computed(request)  # its accepted drafts' blocks, as a decode of each would have
        if item.draft_state_rows and accepted < item.num_draft:
            request.rollback_state_row = item.draft_state_rows[accepted]

    def check_length_stop(self, request: Request) -> RequestStatus | None:
        status = request.check_stop_token()
        if status is None and len(request.all_token_ids) >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        return status

    # ---- one step, in three parts ---------------------------------------------------------

    def draft_requests(self) -> list[tuple[Request, int]]:
        """Methods draft_model and mtp: the running requests whose next decode speculates, and how many tokens each
        is to be proposed (the engine has its draft model or MTP head propose them, then passes them to
        schedule())."""
        decodes = self._decodes()
        budget = self._draft_budget(decodes)
        wanted = []
        for request in decodes:
            k = self.speculation.draft_length(request, budget, self.max_model_len)
            if k:
                wanted.append((request, k))
                budget -= k
        return wanted

    def _decodes(self) -> list[Request]:  # running requests one token behind
        return [request for request in self.running
                if request.request_id not in self.held and request.num_tokens - request.num_computed_tokens == 1
                and not self._done_once_read(request)]

    def _draft_budget(self, decodes: list[Request]) -> int:
        """Drafts a step of these decodes may hold: none past disable_by_batch_size decodes, and within the step's
        token budget beyond the one token every decode claims."""
        if self.speculation is None or len(decodes) > self.speculation.config.disable_by_batch_size:
            return 0
        return self.config.max_num_batched_tokens - len(decodes)

    def _schedule_decodes(self, scheduled: list[ScheduledRequest]) -> int:
        """Every running request one token behind gets its decode (with a proposal to verify, when speculating);
        returns the tokens they claim."""
        decodes = self._decodes()
        draft_budget = self._draft_budget(decodes)
        num_decode = 0
        for request in decodes:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            item = self._verify_item(request, draft_budget) if draft_budget > 0 else None
            draft_budget -= item.num_draft if item is not None else 0
            if item is None:
                new_blocks = self._allocate_or_preempt(request, 1, scheduled)
                if new_blocks is None:
                    continue  # the request itself was preempted
                item = self._make_item(request, 1, new_blocks)
            scheduled.append(item)
            num_decode += len(item.token_ids)
        return num_decode

    def _verify_item(self, request: Request, max_drafts: int) -> ScheduledRequest | None:
        """The request's decode with its proposal of at most max_drafts, or None (no proposal, no room: a plain
        decode). Never preempts: lookahead blocks are only taken when free."""
        spec = self.speculation.config
        if spec.method != "ngram":  # draft_model, mtp: proposed before the step, at the lengths draft_requests() chose
            drafts = list(self._proposals.get(request.request_id, ())[:max_drafts])
        else:
            drafts = self.speculation.lookup(request, max_drafts, self.max_model_len)
        if not drafts or (new_blocks := self.kv_cache.allocate(request, 1 + len(drafts))) is None:
            return None
        return self._make_item(request, 1 + len(drafts), new_blocks, drafts=tuple(drafts))

    def _schedule_running_prefills(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        used = 0
        for request in list(self.running):
            remaining = request.num_tokens - request.num_computed_tokens
            if request.status != RequestStatus.RUNNING or remaining <= 1 or used >= budget or \
                    request.request_id in self.held:
                continue
            num_new = min(remaining, budget - used)
            new_blocks = self._allocate_or_preempt(request, num_new, scheduled)
            if new_blocks is None:
                continue
            scheduled.append(self._make_item(request, num_new, new_blocks))
            used += num_new
        return used

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        used, skipped = 0, []
        while self.waiting and budget - used > 0 and len(self.running) < self.config.max_num_seqs:
            if self.state_pool is not None and self.state_pool.num_free == 0:
                break  # every state slot is taken: wait for a running request to leave
            request = self.waiting.popleft()
            if request.request_id in self.held or request.num_placeholders:  # preempted with a step running
                skipped.append(request)
                continue
            hits, num_hit_tokens = self.kv_cache.find_cached_prefix(request)
            if self.kv_cache.is_prefix_in_flight(request, len(hits)):
                skipped.append(request)  # another request computes this prefix right now: share it next step
                continue
            num_new = min(request.num_tokens - num_hit_tokens, budget - used)
            new_blocks = self.kv_cache.allocate(request, num_new, hits)
            if new_blocks is None:
                self.waiting.appendleft(request)  # no room: wait for blocks; FCFS keeps it first
                break
            request.num_computed_tokens = num_hit_tokens
            restore = self.kv_cache.restore_row(request, len(hits))
            if restore is not None:
                self.kv_cache.snapshots.acquire(restore)  # pinned until the step has copied it
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            request.slot = self._free_slots.pop()
            if self.state_pool is not None:
                request.state_slot = self.state_pool.allocate()
            self.running.append(request)
            scheduled.append(self._make_item(request, num_new, new_blocks, is_new=True, restore=restore))
            used += num_new
        self.waiting.extendleft(reversed(skipped))
        return used

    # ---- helpers ----------------------------------------------------------------------------

    def _done_once_read(self, request: Request) -> bool:
        """Its placeholders will reach max_tokens or max_model_len: no step after them."""
        return bool(request.num_placeholders) and (
            request.num_output_tokens + request.num_placeholders >= request.sampling_params.max_tokens
            or request.num_tokens >= self.max_model_len)

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled: list[ScheduledRequest]):
        """Blocks for a running request, preempting the newest running requests until it fits.

        A victim already scheduled in this step loses its slot in the step too.
        """
        while True:
            new_blocks = self.kv_cache.allocate(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            self._preempt(victim)
            self._settle_snapshots([item for item in scheduled if item.request_id == victim.request_id],
                                   commit=False)
            scheduled[:] = [item for item in scheduled if item.request_id != victim.request_id]
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.rollback_state_row = None  # its state is recomputed (or restored from a snapshot) on resume
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        if request.state_slot is not None:
            self.state_pool.free(request.state_slot)
            request.state_slot = None
        self._released.append(request.request_id)

    def _settle_snapshots(self, items, commit: bool) -> None:
        """After a step (commit): its snapshots become restorable and restore sources are unpinned.

        Without commit (a request dropped from the step being scheduled) its pending rows are freed.
        """
        snapshots = self.kv_cache.snapshots
        if snapshots is None:
            return
        for item in items:
            for _, row in item.snapshot_writes:
                if commit:
                    snapshots.commit(row)
                else:
                    snapshots.cancel(row)
            if item.restore_snapshot is not None:
                snapshots.release(item.restore_snapshot)

    def _make_item(self, request: Request, num_new: int, new_blocks, is_new: bool = False,
                   restore: int | None = None, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        """num_new tokens from the request's first not computed; drafts: proposed tokens after them (in
        num_new)."""
        start = request.num_computed_tokens
        new = None
        if is_new:
            new = NewRequestData(tuple(request.prompt_token_ids), tuple(request.output_token_ids),
                                 request.sampling_params, request.stop_ids())
        known = tuple(request.all_token_ids[start : start + num_new - len(drafts)])
        rollback, request.rollback_state_row = request.rollback_state_row, None
        return ScheduledRequest(
            request_id=request.request_id,
            slot=request.slot,
            state_slot=request.state_slot,
            token_ids=known + (PLACEHOLDER,) * (num_new - len(drafts) - len(known)) + drafts,
            start_position=start,
            new_block_ids=tuple(b.block_id for b in new_blocks),
            sample=start + num_new - len(drafts) == request.num_tokens and request.sampling_params.pooling is None,
            new=new,
            restore_snapshot=restore,
            snapshot_writes=self.kv_cache.plan_snapshots(request, start, start + num_new),
            num_prompt_logits=_num_prompt_logits(request, start, start + num_new),
            num_draft=len(drafts),
            draft_state_rows=self._draft_state_rows(request, len(drafts)),
            rollback_state_row=rollback,
        )

    def _draft_state_rows(self, request: Request, num_draft: int) -> tuple[int, ...]:
        """Hybrid models: the rollback rows of the request's state slot, one per draft, after the running slots
        and the prefix cache's snapshot rows (the runner binds them: RunnerSetup.num_draft_state_rows)."""
        if not num_draft or request.state_slot is None:
            return ()
        snapshots = self.kv_cache.snapshots
        first = self.state_pool.num_slots + (snapshots.num_rows if snapshots is not None else 0)
        first += request.state_slot * self.speculation.config.num_speculative_tokens
        return tuple(range(first, first + num_draft))


def _num_prompt_logits(request: Request, start: int, end: int) -> int:
    """prompt_logprobs: how many rows of the chunk [start, end), from its start, predict a prompt token."""
    # With output tokens the whole prompt already ran and its logprobs went out: a resume after
    # preemption recomputes the prompt's KV only.
    if request.sampling_params.prompt_logprobs is None or request.output_token_ids:
        return 0
    return max(0, min(end, request.num_prompt_tokens - 1) - start)
