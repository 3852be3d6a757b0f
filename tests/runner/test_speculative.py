"""Speculative decoding's proposal and verification (core/ and runner/speculative.py): n-gram lookup, acceptance,
and verification that keeps the target's distribution exactly: a statistical test over a tiny vocabulary with a
fixed seed, which a biased acceptance rule fails."""

from __future__ import annotations

import pytest
import torch

from pagellm.core.speculative import ngram_proposal
from pagellm.runner.speculative import accepted_prefix


def test_ngram_lookup_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_proposal(tokens, 1, 3, 2) == [7, 8]  # "2 3" last seen before "7 8" (n = 3 has no match)
    assert ngram_proposal(tokens + [7], 1, 3, 4) == [8, 5, 2, 3]  # "2 3 7" matches: the longest n wins
    assert ngram_proposal([5, 6, 7, 8], 1, 2, 3) == []  # nothing recurs
    assert ngram_proposal([4, 4, 4], 1, 1, 5) == [4] * 5  # the copy runs on into its own tokens
    assert ngram_proposal([1, 2, 3, 1, 2, 3, 1], 1, 2, 7) == [2, 3, 1, 2, 3, 1, 2]  # a period of three, repeated
    with pytest.raises(ValueError, match="min_n"):
        ngram_proposal([1, 2], 3, 2, 1)


def test_accepted_prefix_keeps_the_drafts_the_samples_reproduce():
    samples = [5, 6, 7, 8]  # the target's token after the decode token and after each draft
    assert accepted_prefix([5, 6, 9], samples) == 2  # emitted: 5, 6, then the target's 7
    assert accepted_prefix([5, 6, 7], samples) == 3  # all accepted, then the bonus token 8
    assert accepted_prefix([1, 6, 7], samples) == 0
    assert accepted_prefix([], [4]) == 0  # a plain decode


def _sample_then_match(proposed: list[int], target: torch.Tensor, generator: torch.Generator) -> list[int]:
    """The engine's rule for one verify step: every position sampled from its target row (row i: after i accepted
    drafts), the drafts the samples reproduce kept, then the sample after them."""
    samples = [int(torch.multinomial(row, 1, generator=generator)[0]) for row in target]
    return samples[:accepted_prefix(proposed, samples) + 1]


def _biased(proposed: list[int], target: torch.Tensor, generator: torch.Generator) -> list[int]:
    """A rule that, where a draft was rejected, draws the position again from p itself (the draft included)."""
    emitted = _sample_then_match(proposed, target, generator)
    if len(emitted) <= len(proposed):
        emitted[-1] = int(torch.multinomial(target[len(emitted) - 1], 1, generator=generator)[0])
    return emitted


def _emitted_first_two(verify, target: torch.Tensor, proposed: list[int], samples: int, seed: int):
    """Counts of the first emitted token, and of the second where the first was the first draft, accepted (the
    target's second row is its distribution after that token)."""
    generator = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(target.shape[1]), torch.zeros(target.shape[1])
    for _ in range(samples):
        emitted = verify(proposed, target, generator)
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    return first, second


def test_verification_keeps_the_target_distribution():
    """6,000 verify steps of one proposal (a lookup's: the same every time, one-hot) over a 4-token vocabulary: the
    first emitted token is distributed as the target's first row, and the second, after the first draft was
    accepted, as its second row (to 0.035, ~4 standard errors); a rule that redraws a rejected position from p
    itself (too much of the draft) is caught by the same check."""
    generator = torch.Generator().manual_seed(3)
    target = torch.softmax(2 * torch.randn(3, 4, generator=generator, dtype=torch.float64), -1)
    proposed = [int(target[0].argmax()), 1]  # the first draft often accepted
    first, second = _emitted_first_two(_sample_then_match, target, proposed, 6000, 11)
    assert (first / first.sum() - target[0]).abs().max() < 0.035
    assert second.sum() > 300 and (second / second.sum() - target[1]).abs().max() < 0.035
    first, _ = _emitted_first_two(_biased, target, proposed, 6000, 11)
    assert (first / first.sum() - target[0]).abs().max() > 0.05
