"""Speculative decoding, the scheduler's half: what a request proposes this step, and how long its drafts are.

    ngram_proposal   prompt lookup (vLLM's `ngram`, llama.cpp's ngram-simple): the tokens that followed the latest
                     earlier occurrence of the sequence's last n tokens, n from max_n down to min_n
    DraftLength      a request's draft length from its accepted lengths so far: the k that emits the most tokens
                     per unit of step cost, 0 (plain decode) while no k pays, probed again later
    Speculation      the scheduler's speculation state: each running request's DraftLength, and the counters

A request's proposal rides in its decode item (ScheduledRequest.num_draft: the item's last tokens); the runner
samples every position and keeps the longest prefix the target agrees with (runner/speculative.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagellm.config import SpeculativeConfig
from pagellm.request import Request

# Verify steps a request's acceptance estimate starts from, and after how many plain decode steps a request whose
# drafts did not pay is tried again with one token.
_PRIOR_STEPS = 2
_PROBE_AFTER = 16
_DECAY = 0.75  # per verify step: the estimate follows the text as it changes


def ngram_proposal(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """k tokens copied from after the latest earlier occurrence of the last n tokens (the longest n that has one,
    from max_n down to min_n); [] when none recurs. The copy runs on into its own tokens where the occurrence is
    recent (as an LZ77 match may overlap itself): text repeating with a short period is proposed k at a time."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"ngram_proposal: need 1 <= min_n ({min_n}) <= max_n ({max_n}) and k ({k}) >= 1")
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        # windows starting before the suffix itself: a match must leave at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most recent context predicts best
            period = len(seq) - start  # how far back the copy reads: it repeats that stretch
            return [int(seq[start + i % period]) for i in range(k)]
    return []


class DraftLength:
    """One request's draft length, from the accepted lengths of its own verify steps.

    Acceptance on text is bursty: a lookup lands in a passage being copied (drafts accepted until the passage
    changes) or misses (the first rejected). So two rates describe it: that the first draft is accepted, and that
    a draft after an accepted one is, each counted over the drafts that reached it (a short proposal says
    nothing past its end), counts decaying by _DECAY per verify step. Draft j is then accepted with chance
    first * next^(j - 1), and the draft length is the k that maximises the tokens a step emits, 1 + the sum of
    those chances up to k, per unit of its cost, 1 + cost * k (draft_token_cost, plus sampled_row_cost for a
    request that samples). When no k beats a plain decode the
    request stops proposing; after _PROBE_AFTER plain decodes it tries one draft again.
    """

    def __init__(self, config: SpeculativeConfig, sampled: bool = False):
        """sampled: the request samples (not greedy), so each draft also costs a sampled row."""
        self.max_k = config.num_speculative_tokens
        self.cost = config.draft_token_cost + (config.sampled_row_cost if sampled else 0.0)
        self.adaptive = config.adaptive
        # (drafts that reached the position, drafts accepted there): the first draft, and every later one; a prior
        # of _PRIOR_STEPS drafts each: half the first ones accepted, most later ones (a copy goes on)
        self._first = [float(_PRIOR_STEPS), _PRIOR_STEPS * 0.5]
        self._next = [float(_PRIOR_STEPS), _PRIOR_STEPS * 0.8]
        self._idle_steps = 0
        self._misses = 0  # lookups in a row that found nothing to propose
        self._launched_ahead = 0  # async steps launched since may_propose last let a lookup run

    def rates(self) -> tuple[float, float]:
        """(chance the first draft is accepted, chance a draft after an accepted one is)."""
        return self._first[1] / self._first[0], self._next[1] / self._next[0]

    def best_k(self) -> int:
        """The draft length that pays best by the measured rates (0: none beats a plain decode)."""
        if not self.adaptive:
            return self.max_k
        first, after = self.rates()
        best_k, best, emitted, chance = 0, 1.0, 1.0, first
        for k in range(1, self.max_k + 1):
            emitted += chance
            chance *= after
            if emitted / (1.0 + self.cost * k) > best:
                best_k, best = k, emitted / (1.0 + self.cost * k)
        return best_k

    def may_propose(self) -> bool:
        """Whether the next decode may propose: what async scheduling waits for. A request whose lookups keep
        finding nothing (text that does not repeat) lets steps launch ahead, and waits for one every _PROBE_AFTER
        of them to look again."""
        if self._misses >= _PROBE_AFTER:
            self._launched_ahead += 1
            if self._launched_ahead < _PROBE_AFTER:
                return False
            self._launched_ahead = 0
            return True
        return self.best_k() > 0 or self._idle_steps + 1 >= _PROBE_AFTER

    def looked_up(self, found: bool) -> None:
        """A lookup ran for the request's decode: whether it found a proposal."""
        self._misses = 0 if found else self._misses + 1

    def next_k(self) -> int:
        """Drafts to propose this step (0: a plain decode)."""
        best_k = self.best_k()
        if best_k:
            return best_k
        self._idle_steps += 1
        if self._idle_steps < _PROBE_AFTER:
            return 0
        self._idle_steps = 0  # acceptance may have changed with the text: measure again
        return 1

    def record(self, proposed: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of its `proposed` drafts."""
        for counts in (self._first, self._next):
            counts[0] *= _DECAY
            counts[1] *= _DECAY
        self._first[0] += 1
        self._first[1] += accepted > 0
        later_reached = min(proposed, accepted + 1) - 1  # drafts 2.. that came after an accepted one
        self._next[0] += max(later_reached, 0)
        self._next[1] += max(accepted - 1, 0)


class Speculation:
    """The scheduler's speculation state: each request's DraftLength, and the acceptance counters (stats)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._lengths: dict[str, DraftLength] = {}
        self.num_verify_steps = self.num_draft_tokens = self.num_accepted_tokens = 0

    def draft_length(self, request: Request, max_drafts: int, max_model_len: int) -> int:
        """How many tokens to propose for the request's decode (0: none): its DraftLength's choice, within
        max_drafts, max_tokens and the context."""
        params = request.sampling_params
        if request.num_placeholders or max_drafts < 1:
            return 0  # tokens still on their way (async)
        lengths = self._lengths.get(request.request_id)
        if lengths is None:  # a draft of a sampling or structured request costs a sampled (or masked) row too
            sampled = not params.is_greedy or params.structured_outputs is not None
            lengths = self._lengths[request.request_id] = DraftLength(self.config, sampled)
        # the emitted tokens (drafts + 1) must fit max_tokens and the context
        room = min(params.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1
        return max(0, min(lengths.next_k(), room, max_drafts))

    def may_propose(self, request: Request) -> bool:
        """Whether the request's next decode would look for drafts (a new request does): async scheduling then
        waits for its token instead of launching that decode ahead, where no lookup can run."""
        lengths = self._lengths.get(request.request_id)
        return lengths is None or lengths.may_propose()

    def lookup(self, request: Request, max_drafts: int, max_model_len: int) -> list[int]:
        """Method ngram: the request's proposal, at most draft_length tokens (none: a plain decode)."""
        k = self.draft_length(request, max_drafts, max_model_len)
        if not k:
            return []
        drafts = ngram_proposal(request.all_token_ids, self.config.prompt_lookup_min, self.config.prompt_lookup_max, k)
        self._lengths[request.request_id].looked_up(bool(drafts))
        return drafts

    def record(self, request_id: str, proposed: int, accepted: int, running: bool) -> None:
        """A verify step's outcome; `running`: the request goes on (its draft length learns from it)."""
        self.num_verify_steps += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if running and request_id in self._lengths:
            self._lengths[request_id].record(proposed, accepted)

    def forget(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)
