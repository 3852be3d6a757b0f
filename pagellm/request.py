"""Request: one generation's tokens, progress and status, as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from typing import Sequence

from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its KV was freed and will be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """H(parent, tokens): a block's hash covers its whole prefix through the parent.

    Python's tuple hash is enough inside one process; a hit is always confirmed by
    comparing token ids (BlockPool.lookup), so a collision cannot return wrong KV.
    """
    return hash((parent_hash, token_ids))


def stop_ids_of(params: SamplingParams, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
    """The ids that end a request when sampled: EOS (unless ignore_eos) and stop_token_ids, sorted."""
    return tuple(sorted((set() if params.ignore_eos else set(eos_token_ids)) | set(params.stop_token_ids)))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        block_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # advanced when a step is scheduled (the step's tokens count as computed)
        # Tokens a scheduled step samples, not yet read back: a step scheduled while the previous one still runs
        # (async scheduling) feeds them from the device. They count in num_tokens, not in all_token_ids.
        self.num_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        self.slot: int | None = None  # row in the runner's persistent buffers while running
        self.state_slot: int | None = None  # hybrid models: its recurrent-state slot while running
        self.rollback_state_row: int | None = None  # hybrid models: the state after a verify's accepted tokens
        self.first_scheduled_time: float | None = None
        self._block_size = block_size
        self.block_hashes: list[int] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first num_output_tokens (a verify step's tokens past a stop string)."""
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        del self.output_token_ids[num_output_tokens:]
        del self.block_hashes[len(self.all_token_ids) // self._block_size:]

    def _update_block_hashes(self) -> None:
        """Hash every newly completed full block (incremental: each block hashed once)."""
        bs = self._block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, tuple(self.all_token_ids[i * bs : (i + 1) * bs])))

    def block_token_ids(self, index: int) -> tuple[int, ...]:
        bs = self._block_size
        return tuple(self.all_token_ids[index * bs : (index + 1) * bs])

    def stop_ids(self) -> tuple[int, ...]:
        return stop_ids_of(self.sampling_params, self.eos_token_ids)

    def check_stop_token(self) -> RequestStatus | None:
        """Finish on EOS, a stop token id or max_tokens (stop strings are checked on text by the engine)."""
        params, last = self.sampling_params, self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
