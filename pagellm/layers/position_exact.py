"""Pointwise functions whose value for an element does not depend on its place in the tensor.

On a CPU torch runs a tensor's elements in whole vectors and the rest (a tail: past the last whole vector of the
tensor, or of a thread's share of it) through the C library's scalar function, and for several functions (fp32
sigmoid, silu, softplus and log1p on the AVX-512 host measured) the two differ in the last bit for some of the
values. So a token's value would depend on how many tokens share its step and where it sits: after a prefix
hit, in a chunk, in a verify step beside other requests, where the engine promises the same bits. Computed in
fp64 and rounded once to the input's dtype, the two paths can still differ in fp64's last bit, which the rounding
hides unless the value straddles a rounding point of the narrower type.

For the small per-token tensors of a step whose width leaves a tail ([T, 1], [T, heads]). Wide activations (the
conv's and gated norm's silu, Qwen3-Next's attention gate) stay in torch: a row a multiple of the vector width
leaves no tail as long as torch's thread shares (past 32768 elements) also start on vector boundaries, which two
threads do for the models' widths but three, say, may not; fp64 there would cost more than the step's matmuls.
Applied on every device alike (on a GPU two conversions of a tiny tensor). Measured: docs/benchmarks/
2026-11-29-xeon-amx-host.md, section 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softplus_any_position(x: torch.Tensor) -> torch.Tensor:
    """softplus(x) in x's dtype, the same bits at any place in any tensor (Gated DeltaNet's decay g)."""
    return F.softplus(x.double()).to(x.dtype)


def sigmoid_any_position(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) in x's dtype, the same bits at any place in any tensor (Gated DeltaNet's beta [T, Hv], a MoE
    layer's shared-expert gate [T, 1])."""
    return torch.sigmoid(x.double()).to(x.dtype)
