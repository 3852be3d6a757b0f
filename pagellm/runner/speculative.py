"""Speculative decoding's pieces that do not touch the engine (issue 55; the engine does not call them yet):
proposing tokens by n-gram lookup in a request's own tokens, and verifying proposals against the target model's
distributions so that what is emitted is distributed exactly as the target's own sampling would be.

    ngram_proposal    prompt lookup (vLLM's `ngram`, llama.cpp's ngram-simple): the tokens that followed the
                      latest earlier occurrence of the sequence's last n tokens, n from max_n down to min_n
    greedy_verify     the longest prefix of the proposal that agrees with the target's argmax, then the target's
                      own token at the first disagreement (or the bonus token after a fully accepted proposal)
    rejection_verify  Leviathan et al. (2023): draft token x_i accepted with probability min(1, p_i(x) / q_i(x));
                      at the first rejection a token from norm(max(0, p_i - q_i)); after k acceptances a bonus
                      token from p_k. A proposal with no distribution (n-gram) is one-hot: q_i(x_i) = 1.

Verification runs on the device over [k + 1, V] rows: the number accepted stays a tensor until the step's one
read-back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


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


def greedy_verify(proposed: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """proposed [k], target_ids [k + 1] (the target's argmax after each prefix) -> (accepted count (a 0-d
    tensor), the emitted tokens [k + 1], of which the first accepted + 1 count)."""
    k = proposed.shape[0]
    agree = (proposed == target_ids[:k]).to(torch.int64)
    accepted = agree.cumprod(0).sum()
    return accepted, target_ids  # the target's tokens: equal to the proposal's up to `accepted`, then its own


def rejection_verify(proposed: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """proposed [k] token ids; draft_probs [k, V] (None: one-hot proposals, an n-gram's); target_probs [k + 1, V]
    (row i: the target's distribution after the first i proposed tokens) -> (accepted count, emitted [k + 1]):
    the proposal's first `accepted` tokens, then one drawn from the residual at the first rejection (or the bonus
    row after k acceptances); positions past it are unspecified."""
    k = proposed.shape[0]
    rows = torch.arange(k, device=proposed.device)
    p = target_probs[rows, proposed]  # [k]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, proposed]
    uniform = torch.rand(k, generator=generator, device=proposed.device, dtype=p.dtype)
    accept = (uniform * q < p).to(torch.int64)  # u < min(1, p / q), without dividing by a zero q
    accepted = accept.cumprod(0).sum()
    # the token at row `accepted`: residual max(0, p - q) there (k: the bonus row, plain p)
    draft = torch.zeros_like(target_probs)
    if draft_probs is None:
        draft[rows, proposed] = 1.0
    else:
        draft[:k] = draft_probs
    residual = (target_probs - draft).clamp_min(0.0)
    residual[k] = target_probs[k]
    row = residual[accepted]
    total = row.sum()
    # a residual of zero mass happens only where p == q: any draw from p is then the target's (never reached
    # with accepted < k, since p == q accepts with probability 1)
    row = torch.where(total > 0, row / total.clamp_min(1e-30), target_probs[accepted])
    token = torch.multinomial(row, 1, generator=generator)[0]
    emitted = torch.cat([proposed, proposed.new_zeros(1)])
    emitted[accepted] = token
    return accepted, emitted
