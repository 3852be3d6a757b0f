"""Dense linear layers on a CPU: nn.Linear, whose product of a few bf16 rows runs the native kernel
(kernels/cpu/bf16_gemv.py) at the plan's level, and torch's F.linear otherwise; and, for the layers a module names
in its `row_exact_linears` (a MoE layer's router and shared-expert gate), the product at every M through a kernel
whose row bits do not depend on the batch: kernels/cpu/f32_rows.py for fp32 weights, bf16_gemv for bf16.

The loader makes every plain nn.Linear of a model it loads for a CPU one of these, sharing its parameters (after
the q/k/v and gate/up joins): the same names, the same state dict, the same weights in place. A module's forward
and the bound layer's step call one callable, so the two give the same bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.cpu import bf16_gemv, f32_rows
from pagellm.layers.kernel_user import KernelUser


class DenseLinear(KernelUser, nn.Linear):
    rows_exact = False  # its rows through a batch-independent kernel at every M (use_dense_kernels sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound_matmul()(x)

    def bound_matmul(self):
        """x -> x W^T (+ b) for a contiguous weight (and bias of its dtype) on the CPU where the level has the kernel:
        bf16 through bf16_gemv (up to its MAX_ROWS rows, torch's GEMM above; at every M where rows_exact), fp32
        where rows_exact through f32_rows; else F.linear. Made again once either parameter, its data, dtype, shape
        or device, or rows_exact changed (the kernels read raw memory)."""
        weight, bias = self.weight, self.bias
        key = (self.rows_exact, *(None if t is None else (id(t), t.data_ptr(), t.dtype, t.shape, t.device)
                                  for t in (weight, bias)))
        bound = self.bindings.get("matmul")
        if bound is None or bound[0] != key:
            in_place = weight.device.type == "cpu" and weight.is_contiguous() and (
                bias is None or (bias.dtype == weight.dtype and bias.is_cpu and bias.is_contiguous()))
            if in_place and weight.dtype == torch.bfloat16 and bf16_gemv.available(self.kernel_level):
                fn = bf16_gemv.SmallBatchLinear(weight, bias, self.kernel_level,
                                                max_rows=None if self.rows_exact else bf16_gemv.MAX_ROWS)
            elif (in_place and self.rows_exact and weight.dtype == torch.float32
                  and f32_rows.available(self.kernel_level)):
                fn = f32_rows.RowExactLinear(weight, bias, self.kernel_level)
            else:
                fn = functools.partial(F.linear, weight=weight, bias=bias)
            bound = self.bindings["matmul"] = (key, fn)
        return bound[1]

    @classmethod
    def of(cls, linear: nn.Linear) -> DenseLinear:
        """A DenseLinear holding `linear`'s own parameters (no copy)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight = linear.weight
        if linear.bias is not None:
            layer.bias = linear.bias
        return layer


def use_dense_kernels(model: nn.Module, level: str | None) -> int:
    """Every plain nn.Linear of `model` becomes a DenseLinear on the same parameters, calling the kernels at `level`
    (the loader's, as its quantized layers; the runner's plan binds them all again); those its parent names in
    `row_exact_linears` with rows_exact set. Returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                layer = DenseLinear.of(child)
                layer.rows_exact = name in getattr(parent, "row_exact_linears", ())
                layer.use_kernel_level(level)
                setattr(parent, name, layer)
                swapped += 1
    return swapped
