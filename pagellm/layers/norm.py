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

from pagellm.kernels.elementwise import rms_norm
from pagellm.kernels.layer_ops import add_rms_norm
from pagellm.layers.kernel_user import KernelUser


class RMSNorm(KernelUser, nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        out = rms_norm(x, self.flavour_weight(), self.eps, self.unit_offset, self.kernel_level)
        return out if out is not None else self.reference(x)

    def residual(self, h: torch.Tensor, x: torch.Tensor | None,
                 post: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's step between blocks: h + post(x) (post None: x; x None: h unchanged), and this
        norm of it. One fused kernel call where it applies: at decode that is 1 call instead of 3."""
        if x is None:
            return h, self(h)
        if post is None or self.same_kind(post):
            fused = add_rms_norm(h, x, None if post is None else post.flavour_weight(), self.flavour_weight(),
                                 self.eps, self.unit_offset, self.kernel_level)
            if fused is not None:
                return fused
        h = h + (x if post is None else post(x))
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
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"
