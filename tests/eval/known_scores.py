"""Three positions over a vocabulary of 3 whose scores are worked out by hand, for the per-position scores of
`pagellm eval perplexity` and `pagellm bench accuracy` (pagellm/eval/perplexity.py).

    position  reference p          model q                next token
    A         (1/2, 1/4, 1/4)      (1/64, 1/64, 31/32)    0    tops differ (0 vs 2)
    B         (1/4, 1/2, 1/4)      (1/4, 1/2, 1/4)        1    same
    C         (1/8, 1/8, 3/4)      (1/4, 1/4, 1/2)        2    same

Every expected value below is written term by term from these probabilities (natural logs), independently of the
code under test: a wrong direction, a missing sum over the vocabulary, a log base other than e or a missing softmax
each gives another number. The logits are log-probabilities shifted by a different constant per row, so only a
softmax recovers the probabilities.
"""

from __future__ import annotations

import math

import torch

REFERENCE = [[1 / 2, 1 / 4, 1 / 4], [1 / 4, 1 / 2, 1 / 4], [1 / 8, 1 / 8, 3 / 4]]
MODEL = [[1 / 64, 1 / 64, 31 / 32], [1 / 4, 1 / 2, 1 / 4], [1 / 4, 1 / 4, 1 / 2]]
NEXT_TOKENS = [0, 1, 2]


def logits(probabilities: list[list[float]], shift: float) -> torch.Tensor:
    """Rows whose softmax is `probabilities`: log p plus shift, 2 shift, 3 shift (softmax ignores a row's shift)."""
    rows = torch.tensor(probabilities, dtype=torch.float64).log()
    return (rows + shift * torch.arange(1, len(probabilities) + 1, dtype=torch.float64)[:, None]).float()


LN2 = math.log(2)
# -log q(next token): A: -ln(1/64) = 6 ln 2; B: -ln(1/2); C: -ln(1/2)
NLL = [6 * LN2, LN2, LN2]
# exp(mean NLL) = exp(8/3 ln 2) = 2^(8/3)
PPL = 2 ** (8 / 3)
# sqrt((E[x^2] - E[x]^2) / (N - 1)) with x = (6, 1, 1) ln 2: ((38/3 - 64/9) / 2) ln^2 2 = 25/9 ln^2 2
PPL_ERROR = PPL * 5 / 3 * LN2

# KL(reference || model) = sum_i p_i ln(p_i / q_i)
KL = [1 / 2 * math.log(32) + 1 / 4 * math.log(16) + 1 / 4 * math.log(8 / 31),  # A
      0.0,  # B: the same distribution
      1 / 8 * math.log(1 / 2) + 1 / 8 * math.log(1 / 2) + 3 / 4 * math.log(3 / 2)]  # C
KL_MEAN = (KL[0] + KL[2]) / 3
KL_ERROR = math.sqrt(((KL[0] ** 2 + KL[2] ** 2) / 3 - KL_MEAN ** 2) / 2)
# KL(model || reference) = sum_i q_i ln(q_i / p_i): the other direction, which must not be what is reported
KL_REVERSED = [1 / 64 * math.log(1 / 32) + 1 / 64 * math.log(1 / 16) + 31 / 32 * math.log(31 / 8),
               0.0,
               1 / 4 * math.log(2) + 1 / 4 * math.log(2) + 1 / 2 * math.log(2 / 3)]
KL_REVERSED_MEAN = (KL_REVERSED[0] + KL_REVERSED[2]) / 3

# the tops agree at B and C: 2/3; its standard error: x = (0, 1, 1), sqrt((2/3 - 4/9) / 2) = 1/3
SAME_TOP1 = [False, True, True]
TOP1, TOP1_ERROR = 2 / 3, 1 / 3

# the reference's own perplexity on the same tokens: -ln p = ln 2, ln 2, ln(4/3); exp of their mean
REFERENCE_PPL = (2 * 2 * 4 / 3) ** (1 / 3)
