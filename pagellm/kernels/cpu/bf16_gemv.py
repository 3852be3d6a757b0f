"""Dense bf16 matmuls of a few activation rows through csrc/bf16_gemv.cpp: a decode step of a few requests, a
verify step's drafts. Weights are the checkpoint's own [N, K] bf16 rows, read in place (no copy, no layout of
its own). Where the kernel does not build (no AVX-512 BF16, native kernels off) torch's F.linear stays.

A row's result is the same bits whatever the number of rows and the threads: a step of at most MAX_ROWS rows (one
request verifying up to three drafts, two verifying one) gives the logits of the decode steps it stands for.
measured: docs/benchmarks/2026-11-29-xeon-amx-host.md
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import FLOATS, DtypeCode, Function, Int, Tensor
from pagellm.kernels.cpu.dense_rows import KernelLinear, checked_matmul

# Up to this many rows the kernel (one pass over each tile of weight rows), above it torch's GEMM: a second pass
# reads each tile again, and torch's blocked GEMM was the faster at eight rows on every shape measured.
MAX_ROWS = 4
_BF16 = (torch.bfloat16,)
_MATMUL = Function("pagellm_bf16_matmul", (
    Tensor("x", _BF16), Int("M"), Int("K"), Tensor("weight", _BF16), Int("N"), Tensor("bias", _BF16, optional=True),
    Tensor("out", FLOATS), DtypeCode("out")))
_LIBRARY = native.Library("bf16_gemv", [_MATMUL], "bf16 x bf16 matmul of a few rows", levels=("avx512",),
                          exports_if="pagellm_bf16_gemv_vectorized")  # AVX-512 BF16
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py


def available(at: str | None) -> bool:
    """Whether the kernel runs at level `at` (avx512 with a compiler)."""
    return _LIBRARY.available(at)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, at: str,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in out_dtype (bf16 or fp32; default bf16), all bf16 on
    the CPU; any number of rows (MAX_ROWS is where torch's GEMM is the faster)."""
    return checked_matmul(_LIBRARY.checked(_MATMUL.symbol, at), "bf16_gemv", torch.bfloat16, x, weight, bias,
                          out_dtype or torch.bfloat16)


class SmallBatchLinear(KernelLinear):
    """x -> x W^T (+ bias) for a contiguous bf16 weight (and bias) on the CPU, which the caller checks: this kernel
    up to max_rows rows (None: at every M, a layer whose rows must not depend on the batch), torch's GEMM above
    (dense_rows.KernelLinear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, at: str, max_rows: int | None = MAX_ROWS):
        super().__init__(_LIBRARY.unchecked(_MATMUL.symbol, at), weight, bias, torch.bfloat16, max_rows)
