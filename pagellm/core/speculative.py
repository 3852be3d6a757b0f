"""Speculative decoding, the scheduler's half: what a request proposes this step, and how long its drafts are.

    ngram_proposal   prompt lookup (vLLM's `ngram`, llama.cpp's ngram-simple): the tokens that followed the latest
                     earlier occurrence of the sequence's last n tokens, n from max_n down to min_n
    DraftLength      a request's draft length from its measured acceptance: the k that maximises the tokens
                     emitted per unit of step cost, 0 (plain decode) when no k pays, probed again later

A request's proposal rides in its decode item (ScheduledRequest.num_draft: the item's last tokens); the runner
samples every position and keeps the longest prefix the target agrees with (runner/speculative.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagellm.config import SpeculativeConfig

# Verify steps a request's acceptance estimate starts from (a prior of full acceptance), and after how many plain
# decode steps a request whose drafts did not pay is tried again with one token.
_PRIOR_STEPS = 2
_PROBE_AFTER = 16


def ngram_proposal(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (the longest n that has
    one, from max_n down to min_n); [] when none recurs."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"ngram_proposal: need 1 <= min_n ({min_n}) <= max_n ({max_n}) and k ({k}) >= 1")
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        # windows starting before the suffix itself: a match must leave at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most recent context predicts best
            return seq[start:start + k].tolist()
    return []


def expected_emitted(acceptance: float, k: int) -> float:
    """Tokens a verify step of k drafts emits when each draft is accepted with probability `acceptance`
    (independently): the accepted prefix plus the target's own token, 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


class DraftLength:
    """One request's draft length. Acceptance is estimated from its own verify steps (accepted / proposed, with a
    prior of _PRIOR_STEPS fully accepted steps); k maximises expected_emitted(a, k) / (1 + cost * k), and 0 when
    even k = 1 emits less per cost than a plain decode."""

    def __init__(self, config: SpeculativeConfig):
        self.max_k = config.num_speculative_tokens
        self.cost = config.draft_token_cost
        self.adaptive = config.adaptive
        self.proposed = self.accepted = _PRIOR_STEPS * self.max_k
        self._idle_steps = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed

    def next_k(self) -> int:
        """Drafts to propose this step (0: a plain decode)."""
        if not self.adaptive:
            return self.max_k
        best_k, best = 0, 1.0
        for k in range(1, self.max_k + 1):
            gain = expected_emitted(self.acceptance, k) / (1.0 + self.cost * k)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self._idle_steps += 1
            if self._idle_steps >= _PROBE_AFTER:  # acceptance may have changed with the text: measure again
                self._idle_steps = 0
                return 1
        return best_k

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome. The estimate weighs recent steps more: old counts decay by half per step."""
        self.proposed = self.proposed / 2 + proposed
        self.accepted = self.accepted / 2 + accepted
