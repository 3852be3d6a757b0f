"""fp32 products whose row bits do not depend on the batch, through csrc/f32_rows.cpp: a MoE layer's router and
shared-expert gate (layers/dense.py), so that a token's routing is the same alone, in a chunk, or in a verify step
beside other requests. Every level gives the same bits. Where the kernel does not build (native kernels off),
torch's F.linear stays.
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import Function, Int, Tensor
from pagellm.kernels.cpu.dense_rows import KernelLinear, checked_matmul

_F32 = (torch.float32,)
_MATMUL = Function("pagellm_f32_rows_matmul", (
    Tensor("x", _F32), Int("M"), Int("K"), Tensor("weight", _F32), Int("N"), Tensor("bias", _F32, optional=True),
    Tensor("out", _F32)))
_LIBRARY = native.Library("f32_rows", [_MATMUL], "fp32 matmul of batch-independent rows")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py


def available(at: str | None) -> bool:
    """Whether the kernel runs at level `at`."""
    return _LIBRARY.available(at)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, at: str) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N], all fp32 on the CPU (the checked caller: a tensor it cannot
    take is a binding.KernelArgumentError)."""
    return checked_matmul(_LIBRARY.checked(_MATMUL.symbol, at), "f32_rows", torch.float32, x, weight, bias,
                          torch.float32)


class RowExactLinear(KernelLinear):
    """x -> x W^T (+ bias) for a contiguous fp32 weight (and bias) on the CPU, which the caller checks: this kernel
    at every M (dense_rows.KernelLinear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, at: str):
        super().__init__(_LIBRARY.unchecked(_MATMUL.symbol, at), weight, bias, torch.float32)
