"""Speculative decoding, the runner's half: a verify step's sampling rows, and the tokens it keeps.

Proposals (n-gram lookups, core/speculative.py, or a draft model's greedy tokens, engine_draft.py) come as the last
ScheduledRequest.num_draft tokens of a decode item. The runner samples every position of the item: row i as the
request's own row would be sampled after the first i drafts were accepted (penalties count them, min_tokens counts
them, a seeded row draws token n from its own stream n), and keeps the longest prefix of the drafts that the samples
reproduce, then the sample after it. For a deterministic proposal (a lookup's, a greedy draft's: one-hot, q(x) = 1)
that is exactly Leviathan et al.'s rejection sampling: a draft x is accepted with probability p(x), and a rejected
position's sample is a draw from p without x, i.e. from norm(max(0, p - q)). So the emitted tokens are distributed
as the target's own sampling, a seeded request emits the very tokens it would without speculation, and greedy ones
the argmax path.

    DraftRow          the sampler's row for position i of a verify item (runner/sampler.SamplingRow)
    sampling_rows     a step's sampled slots expanded to one row per sampled position
    accepted_prefix   how many drafts the samples reproduce
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.runner.grammar import RowGrammar
from pagellm.runner.input_batch import SlotState


class DraftRow:
    """Sampling row i of a verify item: the request's slot as if its first i drafts were accepted. `grammar`: its
    matcher advanced by them (structured output), or the previous row's where the grammar refuses a draft: draft
    i is then masked at row i and never accepted, so no later row is kept and their masks do not matter."""

    def __init__(self, state: SlotState, drafts: Sequence[int], grammar: RowGrammar | None = None):
        self.state, self.drafts, self.grammar = state, list(drafts), grammar
        self.generator: torch.Generator | None = None
        if state.generator is not None:  # token n's own stream, as SlotState.reseed derives it
            self.generator = torch.Generator(device=state.generator.device)
            self.generator.manual_seed(state.seed_for(state.num_output_tokens + len(self.drafts)))

    sampling_params = property(lambda self: self.state.sampling_params)
    prompt_token_ids = property(lambda self: self.state.prompt_token_ids)
    stop_ids = property(lambda self: self.state.stop_ids)
    output_token_ids = property(lambda self: self.state.output_token_ids + self.drafts)
    num_output_tokens = property(lambda self: self.state.num_output_tokens + len(self.drafts))


def sampling_rows(states: Sequence[SlotState], drafts: Sequence[tuple[int, ...]]) -> list:
    """One row per sampled position: a slot's own row, then (verify items) one DraftRow per draft."""
    rows: list = []
    for state, proposed in zip(states, drafts):
        rows.append(state)
        grammar = state.grammar
        for i in range(1, len(proposed) + 1):
            if grammar is not None:
                grammar = grammar.after(proposed[i - 1 : i]) or grammar.after(())  # a copy: masks fill in parallel
            rows.append(DraftRow(state, proposed[:i], grammar))
    return rows


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the samples at their positions (sampled[i]: the token after draft i - 1)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return accepted
