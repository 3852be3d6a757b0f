"""Per-slot request state kept by the runner between steps, updated by the scheduler's diffs.

The scheduler sends a request's prompt and sampling parameters once (when it
starts or resumes); afterwards each step only carries the tokens to feed and
the block ids appended. The slot also serves as the sampler's row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.core.types import ScheduledRequest
from pagellm.runner.grammar import Grammars, RowGrammar
from pagellm.sampling_params import SamplingParams

# Spreads per-step seeds of one request far apart (a large odd constant; any would do).
_SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclass
class SlotState:
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_ids: tuple[int, ...] = ()  # masked while fewer than sampling_params.min_tokens are out
    grammar: RowGrammar | None = None  # the matcher of structured_outputs
    num_pending: int = 0  # tokens sampled by launched steps, not yet read back into output_token_ids
    pooled: torch.Tensor | None = None  # an embedding request's pooled hidden state so far [E] (runner/pooling.py)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, those still on their way from the device too."""
        return len(self.output_token_ids) + self.num_pending

    def reseed(self) -> None:
        """Derive this step's random stream from (seed, number of tokens generated so far).

        The draw for output token n then depends only on the seed and n: the same
        seed and prompt give the same output whatever else runs, and a request
        resumed after preemption continues the stream it would have had.
        """
        if self.generator is not None:
            self.generator.manual_seed(self.seed_for(self.num_output_tokens))

    def seed_for(self, num_output_tokens: int) -> int:
        """The seed of the draw for output token `num_output_tokens` (sampling_params.seed is set)."""
        return (self.sampling_params.seed + _SEED_STRIDE * num_output_tokens) % (2**63)


class InputBatch:
    def __init__(self, max_num_seqs: int, device: torch.device, grammars: Grammars | None = None):
        self.device = device
        self.grammars = grammars  # None where this runner does not sample (a tensor-parallel worker)
        self.slots: list[SlotState | None] = [None] * max_num_seqs
        self._slot_of: dict[str, int] = {}

    def apply(self, released_request_ids, scheduled: tuple[ScheduledRequest, ...]) -> list[SlotState]:
        """Apply one step's diff; return the slot of each scheduled request, in order."""
        for request_id in released_request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self.slots[slot] = None
        states = []
        for item in scheduled:
            if item.new is not None:
                state = SlotState(item.request_id, item.new.sampling_params, list(item.new.prompt_token_ids),
                                  list(item.new.output_token_ids), stop_ids=item.new.stop_ids)
                if state.sampling_params.seed is not None:
                    state.generator = torch.Generator(device=self.device)
                spec = state.sampling_params.structured_outputs
                if spec is not None and self.grammars is not None:
                    state.grammar = self.grammars.matcher(spec, state.stop_ids, state.output_token_ids)
                self.slots[item.slot] = state
                self._slot_of[item.request_id] = item.slot
            state = self.slots[item.slot]
            state.block_ids.extend(item.new_block_ids)
            states.append(state)
        return states
