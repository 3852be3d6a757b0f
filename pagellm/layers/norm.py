"""RMSNorm, in the two flavours HF checkpoints use.

    Llama / Mistral / Qwen:  y = w * (x / rms(x))          weights stored around 1
    Gemma:                   y = (1 + w) * (x / rms(x))    weights stored as offsets from 1

The normalisation runs in float32 whatever the model dtype; where the result is
cast back differs between the two flavours, and we copy HF's order exactly so
bf16 results match too.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"
