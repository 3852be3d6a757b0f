"""Dense linear layers on a CPU: nn.Linear, whose product of a few bf16 rows runs the native kernel
(kernels/cpu/bf16_gemv.py) at the plan's level, and torch's F.linear otherwise.

The loader makes every plain nn.Linear of a model it loads for a CPU one of these, sharing its parameters (after
the q/k/v and gate/up joins): the same names, the same state dict, the same weights in place. A module's forward
and the bound layer's step call one callable, so the two give the same bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.cpu import bf16_gemv
from pagellm.layers.kernel_user import KernelUser


class DenseLinear(KernelUser, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound_matmul()(x)

    def bound_matmul(self):
        """x -> x W^T (+ b): bf16_gemv's SmallBatchLinear for a contiguous bf16 weight (and bias) on the CPU where
        the level has the kernel, else F.linear; made again once either parameter, its data, dtype, shape or
        device changed (the kernel reads raw memory)."""
        weight, bias = self.weight, self.bias
        key = tuple((id(t), t.data_ptr(), t.dtype, t.shape, t.device) if t is not None else None
                    for t in (weight, bias))
        bound = self.bindings.get("matmul")
        if bound is None or bound[0] != key:
            kernel = (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.is_contiguous()
                      and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_cpu and bias.is_contiguous()))
                      and bf16_gemv.available(self.kernel_level))
            fn = (bf16_gemv.SmallBatchLinear(weight, bias, self.kernel_level) if kernel
                  else functools.partial(F.linear, weight=weight, bias=bias))
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
    (the loader's, as its quantized layers; the runner's plan binds them all again); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                layer = DenseLinear.of(child)
                layer.use_kernel_level(level)
                setattr(parent, name, layer)
                swapped += 1
    return swapped
