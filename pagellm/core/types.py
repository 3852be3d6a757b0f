"""The only types that cross from the scheduler to the runner (and from a head to its workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, when a request first runs or resumes after preemption: what the slot needs to start."""

    prompt_token_ids: tuple[int, ...]  # for penalties over the prompt
    output_token_ids: tuple[int, ...]  # non-empty only on resume: recomputed like prompt tokens
    sampling_params: SamplingParams
    stop_ids: tuple[int, ...] = ()  # ids that end it (EOS unless ignored, stop_token_ids): banned before min_tokens


# A token a step feeds before the host knows it: the previous step samples it on the device (async scheduling).
PLACEHOLDER = -1


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    slot: int  # row of the runner's persistent per-request buffers; stable while the request runs
    token_ids: tuple[int, ...]  # tokens fed this step (one for a decode, a chunk for a prefill); PLACEHOLDER: not
    # yet read back (the previous step's sample for this request)
    start_position: int  # position of token_ids[0] == tokens already in the KV cache
    new_block_ids: tuple[int, ...]  # appended to the slot's block table this step (the whole table when new)
    sample: bool  # this chunk reaches the last known token, so a next token is sampled
    new: NewRequestData | None = None  # set on first schedule / resume; the slot is (re)initialised
    state_slot: int | None = None  # hybrid models: slot of its recurrent state (core/state_pool.py)
    # Hybrid models with prefix caching (core/snapshot_pool.py): the state row copied into state_slot
    # before the step (a prefix hit), and the (position, state row) pairs to which the state after
    # `position` tokens is copied while the step runs (block boundaries of the prompt).
    restore_snapshot: int | None = None
    snapshot_writes: tuple[tuple[int, int], ...] = ()
    # SamplingParams.prompt_logprobs: the chunk's first rows whose logits score the next prompt token
    # (row p predicts token p + 1). Sent, not derived, because tensor-parallel workers hold no prompt
    # lengths but must join the same LM-head gathers; 0 for every other request.
    num_prompt_logits: int = 0
    # Speculative decoding (core/speculative.py): the last num_draft of token_ids are proposed tokens; every
    # position from the decode token on is sampled, and the longest prefix the target agrees with is kept.
    num_draft: int = 0
    # Hybrid models: rows the state after each of the item's first 1..num_draft tokens is copied to (the
    # rollback points of a verify step), and a row copied into state_slot before this step: the state after the
    # previous verify step's accepted tokens, when it rejected some.
    draft_state_rows: tuple[int, ...] = ()
    rollback_state_row: int | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    # Requests that left since the previous step (finished, aborted, preempted): their slots are free.
    released_request_ids: tuple[str, ...] = ()
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    # (block id, hash) of the blocks this step registered in the prefix cache: forgotten if it fails. Head only.
    cached_blocks: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    # KV blocks and state snapshot rows freed past the prefix cache's budget since the previous step: on a CPU
    # every rank hands their pages back to the OS before the step runs (core/block_pool.py). Sent because each
    # rank holds its own shard of them; a step may carry only these (an idle engine's last step).
    released_blocks: tuple[int, ...] = ()
    released_snapshot_rows: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        """Nothing to run, nothing to release."""
        return not self.scheduled and not self.released_blocks and not self.released_snapshot_rows


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one token (sampled, or a prompt token) and the top-n alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class PromptLogprobs:
    """One chunk's prompt logprobs for one request: entries[i] scores prompt token first_index + i."""

    request_id: str
    first_index: int
    entries: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class StepTimings:
    """Where one step's time went on the process that ran it (the head, when parallel)."""

    host_ms: float = 0.0  # scheduling excluded: input preparation before the model runs, minus the copy
    input_copy_ms: float = 0.0  # building the step's input tensors (ids, positions, attention metadata)
    model_ms: float = 0.0  # forward + LM head
    sample_ms: float = 0.0  # sampler + the blocking read of its output
    host_syncs: int = 0
    reused_step: bool = False  # a pure-decode step prepared by diff from the previous one (decode_inputs.py)
    graph_replayed: bool = False  # a pure-decode step whose forward replayed a CUDA graph (decode_graphs.py)


@dataclass(frozen=True)
class ModelOutput:
    """Per scheduled request that sampled: its new token (and logprobs when asked). A verify step's request
    (ScheduledRequest.num_draft) appears once per token it emits, in order: its accepted drafts, then the target's
    own token."""

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # Requests whose chunk had prompt rows (ScheduledRequest.num_prompt_logits), sampled or not.
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    # (request id, why) of rows whose own post-processing failed (e.g. a token their grammar refuses): they
    # get no token and are failed alone; the other rows' tokens stand.
    failed: tuple[tuple[str, str], ...] = ()
    # Embedding requests whose prompt's last chunk ran this step: (request id, pooled final hidden state)
    pooled: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # What the step cost, returned with it (not read back from the runner): the engine's counters sum them.
    timings: StepTimings = StepTimings()
    message_bytes: int = 0  # the step message a parallel head broadcast to its workers; 0 on one process
