"""The callable both dense CPU kernels bind to a layer (bf16_gemv.SmallBatchLinear, f32_rows.RowExactLinear)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
