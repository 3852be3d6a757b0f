"""fp32 products whose row bits do not depend on the batch, through csrc/f32_rows.cpp: a MoE layer's router and
shared-expert gate (layers/dense.py), so that a token's routing is the same alone, in a chunk, or in a verify step
beside other requests. Every level gives the same bits. Where the kernel does not build (native kernels off),
torch's F.linear stays.
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import Function, Int, Tensor
from pagellm.kernels.cpu.dense_rows import KernelLinear

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
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"f32_rows takes fp32 x [..., {weight.shape[1]}] and an fp32 weight, got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    (n, k) = weight.shape
    rows = x.numel() // k if k else 0
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    if rows:
        _LIBRARY.checked(_MATMUL.symbol, at)(x, rows, k, weight, n, bias, out)
    return out


class RowExactLinear(KernelLinear):
    """x -> x W^T (+ bias) for a contiguous fp32 weight (and bias) on the CPU, which the caller checks: this kernel
    at every M (dense_rows.KernelLinear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, at: str):
        super().__init__(_LIBRARY.unchecked(_MATMUL.symbol, at), weight, bias, torch.float32)
