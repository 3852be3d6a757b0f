"""Speculative decoding's drafters of whole models: a draft model (method draft_model), and the model's own MTP
head (method mtp: HeadDrafts, runner/mtp_drafter.py).

A draft model is a second engine over a smaller model with the same vocabulary, its KV in its own blocks,
proposing each speculating request's next tokens greedily.

Each step, for the requests the scheduler lets speculate (Scheduler.draft_requests), the draft engine runs a
request of their tokens so far for k greedy tokens. Its prefix cache holds the blocks of the round before, so a
round computes only what changed (the tokens accepted since, and the last partial block) and then k decodes, the
requests batched. Greedy proposals are deterministic (one-hot), so the target's verification keeps its exact
distribution as it does for n-gram lookups (runner/speculative.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from pagellm.config import ParallelConfig
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

# What the two tokenizers must encode alike (ids of the same text), besides the vocabulary's size.
_PROBE = "The draft and the target: def f(x):\n    return [x, 3.14, 'é', \"ok\"]  # 42"


class DraftEngine(Protocol):
    """What DraftModel needs of an LLMEngine (the engine builds it: no import back up)."""

    tokenizer: object
    hf_config: object
    max_model_len: int

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def step(self) -> list: ...

    def has_unfinished_requests(self) -> bool: ...

    def shutdown(self) -> None: ...


def make_drafter(engine, engine_class) -> DraftModel | HeadDrafts | None:
    """The drafter of `engine`'s speculative config. Method draft_model: a second engine (`engine_class`) on the
    draft model, alone on this process (no speculation, no steps launched ahead), its KV sized as the target's
    settings say. Method mtp: the model's head, on this process's runner."""
    config = engine.config
    spec = config.speculative
    if spec is not None and spec.method == "mtp":
        return HeadDrafts(engine.runner, engine.scheduler)
    if spec is None or spec.method != "draft_model":
        return None
    draft = dataclasses.replace(config, model=dataclasses.replace(config.model, model=spec.model),
                                speculative=None, parallel=ParallelConfig(),
                                scheduler=dataclasses.replace(config.scheduler, async_scheduling=False))
    return DraftModel(engine_class(draft, skip_tokenizer_init=engine.tokenizer is None),
                      engine.hf_config.vocab_size, engine.tokenizer)


class DraftModel:
    def __init__(self, engine: DraftEngine, target_vocab_size: int, target_tokenizer):
        """A ValueError naming speculative_config.model when the draft's vocabulary is not the target's."""
        self.engine = engine
        if engine.hf_config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {engine.hf_config.vocab_size} tokens, "
                             f"the target {target_vocab_size}: a draft model must share the target's")
        if target_tokenizer is not None and engine.tokenizer is not None and \
                engine.tokenizer.encode(_PROBE) != target_tokenizer.encode(_PROBE):
            raise ValueError("speculative_config.model's tokenizer gives other ids than the target's for the same "
                             "text: a draft model must share the target's vocabulary")
        self._rounds, self._ran_for = 0, ()

    def ran_for(self) -> tuple[str, ...]:
        """The requests of the last round (whose proposal failed, when it did)."""
        return self._ran_for

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, tuple[int, ...]]:
        """{request id: its k greedy draft tokens} for each (request, k); a request the draft cannot hold (past its
        context) gets none."""
        self._ran_for = tuple(request.request_id for request, _ in wanted)
        self._rounds += 1
        target_of = {}
        for request, k in wanted:
            tokens = request.all_token_ids
            if len(tokens) + k > self.engine.max_model_len:
                continue
            try:
                draft_id = self.engine.add_request(list(tokens), SamplingParams(max_tokens=k, temperature=0.0,
                                                                                 ignore_eos=True),
                                                   request_id=f"draft-{self._rounds}-{request.request_id}")
            except ValueError:  # longer than the draft's KV pool holds: this request decodes plainly
                continue
            target_of[draft_id] = request.request_id
        proposals = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    proposals[target_of[output.request_id]] = tuple(output.outputs[0].token_ids)
        return proposals

    def shutdown(self) -> None:
        self.engine.shutdown()


class HeadDrafts:
    """Method mtp: the drafts of the model's MTP head, run by this process's runner, which catches the head up on
    every running request first."""

    def __init__(self, runner, scheduler):
        self.runner, self.scheduler = runner, scheduler

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, tuple[int, ...]]:
        slots = [state for state in self.runner.input_batch.slots if state is not None]  # the runner's block ids
        return self.runner.mtp.propose(wanted, self._running(), {s.request_id: s.block_ids for s in slots})

    def _running(self) -> list[Request]:
        """The requests the head catches up on: the running ones but those held (LLMEngine.hold: a step's
        failure being isolated, this one's too)."""
        return [r for r in self.scheduler.running if r.request_id not in self.scheduler.held]

    def ran_for(self) -> tuple[str, ...]:
        """The requests a failed catch-up ran for."""
        return tuple(request.request_id for request in self._running())

    def shutdown(self) -> None:
        pass
