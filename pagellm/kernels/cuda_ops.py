"""Which of the fused layer ops take a CUDA tensor, and the Triton modules that run them, imported on first use.

kernels/layer_ops.py and kernels/elementwise.py route CUDA tensors here; kernels/attention.py its attention.
Importing triton costs a CPU process time for nothing, and `triton.jit` reads TRITON_INTERPRET when a kernel
module is imported (tests/gpu), hence the import on the first CUDA call.
"""

from __future__ import annotations

import functools
import importlib

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_module(name: str):
    """pagellm.kernels.<name> (triton_attention, triton_layer_ops), imported once."""
    return importlib.import_module(f"pagellm.kernels.{name}")


def layer_ops():
    return triton_module("triton_layer_ops")


def takes(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given is a non-empty contiguous CUDA float tensor (None: not given); one dtype of
    activations is the caller's check."""
    return all(t is None or (t.is_cuda and t.dtype in FLOATS and t.is_contiguous() and t.numel() > 0)
               for t in tensors)
