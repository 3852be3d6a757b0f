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

from pagellm.kernels.reference import layer_ops as reference
from pagellm.layers.kernel_user import KernelUser


class RMSNorm(KernelUser, nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return self.ops.rms_norm(x, self.flavour_weight(), self.eps, self.unit_offset)

    def residual(self, h: torch.Tensor, x: torch.Tensor | None,
                 post: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's step between blocks: h + post(x) (post None: x; x None: h unchanged), and this
        norm of it. One fused call where both norms are of a kind: at decode that is 1 kernel call instead of 3."""
        if x is None:
            return h, self(h)
        if post is None or self.same_kind(post):
            return self.ops.add_rms_norm(h, x, None if post is None else post.flavour_weight(), self.flavour_weight(),
                                         self.eps, self.unit_offset)
        h = h + post(x)
        return h, self(h)

    def same_kind(self, other: RMSNorm) -> bool:
        """Same eps and flavour: one fused call can apply both norms (it takes one eps and flavour)."""
        return (self.eps, self.unit_offset) == (other.eps, other.unit_offset)

    def flavour_weight(self) -> torch.Tensor:
        """The weight as the kernels take it: fp32 for the unit-offset flavour (Gemma adds 1 in fp32), else the
        parameter. The fp32 copy is one of the module's bindings (where a model runs its modules, a copy per call
        would add an allocation and a cast to every norm), made again when the weight is replaced; a bound plan
        takes its copy once."""
        if not self.unit_offset:
            return self.weight
        source = self.weight.data_ptr()
        kept = self.bindings.get("fp32_weight")
        if kept is None or kept[0] != source:
            kept = self.bindings["fp32_weight"] = (source, self.weight.detach().float().contiguous())
        return kept[1]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch ops the kernels are tested against."""
        return reference.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"
