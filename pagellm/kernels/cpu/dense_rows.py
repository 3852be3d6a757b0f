"""What both dense CPU kernels share (bf16_gemv, f32_rows): the checked product of any number of rows, and the
callable they bind to a layer (SmallBatchLinear, RowExactLinear)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def checked_matmul(kernel, name: str, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in out_dtype through the kernel's checked caller
    kernel(x, rows, K, weight, N, bias, out), x and weight of `dtype` on the CPU (a ValueError naming `name`
    otherwise; a tensor the caller cannot take is a binding.KernelArgumentError)."""
    if x.dtype != dtype or weight.dtype != dtype or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name} takes {dtype} x [..., {weight.shape[1]}] and a {dtype} weight, got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    (n, k) = weight.shape
    rows = x.numel() // k if k else 0
    out = torch.empty(*x.shape[:-1], n, dtype=out_dtype)
    if rows:
        kernel(x, rows, k, weight, n, bias, out)
    return out


class KernelLinear:
    """x -> x W^T (+ bias) through kernel(x, rows, K, weight, N, bias, out) for a contiguous weight (and bias) of
    `dtype` on the CPU, which the caller checks, at 1..max_rows rows (None: any); any other input (another dtype,
    more rows, autograd) through F.linear. One callable for a module's forward and for the bound layer's step, so
    the two give the same bits."""

    def __init__(self, kernel, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 max_rows: int | None = None):
        self.weight, self.bias, self.dtype, self.max_rows = weight, bias, dtype, max_rows
        self._fn = kernel
        self._n, self._k = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is None and x.is_cpu and not x.is_contiguous():  # rows that must not depend on the batch
            x = x.contiguous()
        rows = x.numel() // self._k if x.dim() and self._k else 0
        if (rows == 0 or (self.max_rows is not None and rows > self.max_rows) or x.dtype != self.dtype
                or x.shape[-1] != self._k or not x.is_cpu or not x.is_contiguous()
                or torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):  # no autograd here
            return F.linear(x, self.weight, self.bias)
        out = torch.empty(*x.shape[:-1], self._n, dtype=self.dtype)
        self._fn(x, rows, self._k, self.weight, self._n, self.bias, out)
        return out
