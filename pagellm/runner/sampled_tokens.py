"""A launched step's sampled tokens: read back from the device once, then handed to the requests' slots.

ModelRunner.launch queues a step and starts the copy of its sampled ids (and logprobs) to the host;
ModelRunner.collect waits for that copy, the step's one blocking wait, and turns it into the ModelOutput.
Between the two the host is free: async scheduling (engine.py) prepares and launches the next step there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.kernels.transfers import HostRead
from pagellm.core.types import ModelOutput, PromptLogprobs, StepTimings, TokenLogprobs
from pagellm.runner.grammar import GrammarError, accept_sampled
from pagellm.runner.input_batch import SlotState
from pagellm.runner.sampler import SamplerOutput
from pagellm.runner.speculative import accepted_prefix


class SampledTokens:
    """The copy to the host of one step's SamplerOutput, started at construction: ids alone, or ids, sampled
    logprob, rank and top logprobs packed in one [B, 3 + 2K] float tensor (ids are exact in fp32)."""

    def __init__(self, result: SamplerOutput):
        lp = result.logprobs
        if lp is None:
            self._read, self._num_top = HostRead(result.token_ids), None
            return
        packed = torch.cat([result.token_ids[:, None].float(), lp.sampled_logprobs[:, None],
                            lp.sampled_ranks[:, None].float(), lp.top_ids.float(), lp.top_logprobs], dim=1)
        self._read, self._num_top = HostRead(packed), lp.top_ids.shape[1]

    def read(self, rows: list[SlotState]) -> tuple[list[int], tuple[TokenLogprobs | None, ...] | None]:
        """(token ids, each row's logprobs or None; None when no row asked) once the copy has landed."""
        data = self._read.tolist()
        if self._num_top is None:
            return data, None
        k = self._num_top
        token_ids, entries = [], []
        for row, state in zip(data, rows):
            token = int(row[0])
            token_ids.append(token)
            n = state.sampling_params.logprobs
            if n is None:
                entries.append(None)
                continue
            top = tuple((int(i), v) for i, v in zip(row[3 : 3 + n], row[3 + k : 3 + k + n]))
            entries.append(TokenLogprobs(token, row[1], int(row[2]), top))
        return token_ids, tuple(entries)


@dataclass
class LaunchedStep:
    """A step queued on the device: `done` when nothing is left to read (no row sampled), else its sampled
    requests' slots, their proposed tokens (verify items; () for the others), and the copy of their tokens (one
    row per sampled position) on its way."""

    timings: StepTimings  # host, copy and model time, and the prompt-logprob read; sampling is added by collect
    done: ModelOutput | None = None
    sampled: list[SlotState] = field(default_factory=list)
    drafts: list[tuple[int, ...]] = field(default_factory=list)
    rows: list = field(default_factory=list)  # the sampler's rows: one per sampled position (runner/speculative.py)
    tokens: SampledTokens | None = None
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    pooled: tuple[tuple[str, tuple[float, ...]], ...] = ()  # embedding requests finished by this step


def hand_out(step: LaunchedStep, token_ids: list[int], logprobs, timings: StepTimings) -> ModelOutput:
    """Each request's emitted tokens to its slot: its one sample, or a verify item's accepted drafts and the
    sample after them (runner/speculative.py); a grammar may refuse a token: that request alone fails."""
    failed, kept, row = [], [], 0
    entries = logprobs or [None] * len(token_ids)
    for state, drafts in zip(step.sampled, step.drafts or [()] * len(step.sampled)):
        samples = token_ids[row : row + len(drafts) + 1]
        emitted = range(row, row + accepted_prefix(drafts, samples) + 1)
        row += len(drafts) + 1
        state.num_pending -= 1
        state.output_token_ids.extend(token_ids[i] for i in emitted)
        if state.grammar is not None:
            try:
                for i in emitted:
                    accept_sampled(state.request_id, state.grammar, token_ids[i])
            except GrammarError as exc:  # this request alone: the others' tokens stand
                failed.append((state.request_id, str(exc)))
                continue
        kept += [(state.request_id, token_ids[i], entries[i]) for i in emitted]
    ids, tokens, kept_entries = (tuple(x) for x in zip(*kept)) if kept else ((), (), ())
    return ModelOutput(ids, tokens, kept_entries if logprobs else None, step.prompt_logprobs, tuple(failed),
                       step.pooled, timings)
