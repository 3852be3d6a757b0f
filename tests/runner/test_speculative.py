"""Speculative decoding's proposal and verification (core/ and runner/speculative.py): n-gram lookup, acceptance,
and rejection sampling that keeps the target's distribution exactly: a statistical test over a tiny vocabulary
with a fixed seed, which a biased acceptance rule fails."""

from __future__ import annotations

import pytest
import torch

from pagellm.core.speculative import ngram_proposal
from pagellm.runner.speculative import accepted_prefix, rejection_verify


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


def _distributions(seed: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    target = torch.softmax(2 * torch.randn(k + 1, vocab, generator=generator, dtype=torch.float64), -1)
    draft = torch.softmax(2 * torch.randn(k, vocab, generator=generator, dtype=torch.float64), -1)
    return target, draft


def _emitted_first_two(verify, target, draft, samples: int, seed: int, given: int):
    """Counts of the first emitted token, and of the second where the first was the proposal `given`, accepted
    (the target's second row is its distribution after that token)."""
    generator = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(target.shape[1]), torch.zeros(target.shape[1])
    for _ in range(samples):
        if draft is None:
            proposed = torch.tensor([given, 1])  # an n-gram's: the same lookup every time
        else:
            proposed = torch.stack([torch.multinomial(row, 1, generator=generator)[0] for row in draft])
        accepted, emitted = verify(proposed, draft, target, generator)
        first[emitted[0]] += 1
        if accepted >= 1 and emitted[0] == given:
            second[emitted[1]] += 1
    return first, second


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-model", "ngram"])
def test_rejection_sampling_keeps_the_target_distribution(one_hot):
    """6,000 draws over a 4-token vocabulary: the first emitted token is distributed as the target's first row,
    and the second, after the first proposal was accepted as a given token, as its second row (to 0.035, ~4 standard
    errors); a rule that resamples from p instead of the residual is caught by the same check."""
    target, draft = _distributions(3, 2, 4)
    draft = None if one_hot else draft
    given = int(torch.minimum(target[0], draft[0] if draft is not None else target[0]).argmax())  # often accepted
    first, second = _emitted_first_two(rejection_verify, target, draft, 6000, 11, given)
    assert (first / first.sum() - target[0]).abs().max() < 0.035
    assert second.sum() > 300 and (second / second.sum() - target[1]).abs().max() < 0.035

    def biased(proposed, draft_probs, target_probs, generator):  # on rejection, a draw from p itself: too much x
        accepted, emitted = rejection_verify(proposed, draft_probs, target_probs, generator)
        if accepted < proposed.shape[0]:
            emitted[accepted] = torch.multinomial(target_probs[accepted], 1, generator=generator)[0]
        return accepted, emitted
    first, _ = _emitted_first_two(biased, target, draft, 6000, 11, given)
    assert (first / first.sum() - target[0]).abs().max() > 0.05
