"""A sampled row's token drawn from its filtered probabilities (runner/sampler.py's last stage): each picks token i
with probability probs[i] / sum(probs), probs unnormalised, without a host read.

    sample_inverse_cdf               one uniform a row through its cumulative mass (a CPU: V exponentials cost
                                     more than the whole rest of a sampled row)
    sample_exponential_race_no_sync  argmax(probs / q), q ~ Exp(1) (a GPU: one parallel pass)
"""

from __future__ import annotations

import torch


def sample_exponential_race_no_sync(probs: torch.Tensor, noise: torch.Tensor, argmax) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) picks token i with probability probs[i] / sum(probs), like
    torch.multinomial but without its host sync; probs need not be normalised. Overwrites both inputs."""
    # exponential_ can return exactly 0; then a filtered token (prob 0) would become 0/0 = NaN, and
    # argmax picks NaN. Flooring q keeps filtered tokens at 0 and only makes a kept token win outright.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return argmax(probs.div_(noise))


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The token whose share of the row's cumulative mass holds u [B] (uniform in [0, 1)): token i with probability
    probs[i] / sum(probs), a token of probability 0 never; probs need not be normalised. Two levels, so that no
    [B, V] cumulative sum is made: the row's blocks of `block` tokens summed, the block holding u found among them,
    then the token within it. The running sums are float64 (a few hundred block sums and one block a row: cheap),
    so their rounding stays far below a tail token's share of a large vocabulary."""
    rows, vocab = probs.shape
    whole = vocab // block * block
    # a block's sum in float32 is exact to its own rounding (relative); only the running sum needs float64
    sums = probs[:, :whole].view(rows, -1, block).sum(-1).double()  # [B, V // block]
    if whole < vocab:  # the last, shorter block
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True).double()], dim=1)
    cdf = sums.cumsum(-1)  # [B, blocks]
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)  # [B, 1], below the row's total
    chosen = torch.searchsorted(cdf, target, right=True).clamp_max_(sums.shape[1] - 1)  # [B, 1], a block of mass
    # where u falls within the chosen block, as a fraction of its mass, then among its tokens
    mass = sums.gather(1, chosen)  # [B, 1]
    fraction = (target - (cdf.gather(1, chosen) - mass)) / mass
    columns = chosen * block + torch.arange(block, device=probs.device)  # [B, block]
    inside = probs.gather(1, columns.clamp_max(vocab - 1)).to(torch.float64).masked_fill_(columns >= vocab, 0.0)
    within = inside.cumsum(-1)
    at = (fraction.clamp(0.0, 1.0 - 2.0**-52) * within[:, -1:])  # below the block's own total
    # a row without mass (every token filtered) finds no block: it still gets a token of the vocabulary
    return (chosen * block + torch.searchsorted(within, at, right=True)).squeeze(1).clamp_max_(vocab - 1)
