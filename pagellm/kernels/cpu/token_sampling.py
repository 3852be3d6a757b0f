"""A step's sampled rows drawn through the C++ kernel (csrc/sample_rows.cpp): temperature, top-k, top-p, min-p and
the draw from one uniform a row, in one call, the logits only read.

The sampler (runner/sampler.py) binds it where its level has it; its torch chain stays the oracle the kernel is
tested against (tests/kernels/test_sample_rows.py) and the path of a device or level without it.
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import Function, Int, Tensor

_F32 = (torch.float32,)
_SAMPLE = Function("pagellm_sample_rows", (
    Tensor("logits", _F32), Int("rows"), Int("V"), Tensor("temperature", _F32), Tensor("top_k", (torch.int64,)),
    Tensor("top_p", _F32), Tensor("min_p", _F32), Tensor("u", (torch.float64,)), Tensor("out", (torch.int64,))))
# Not at the generic level: without fma its exponentials are emulated, slower than torch's own (measured)
_LIBRARY = native.Library("sample_rows", [_SAMPLE, native.RELEASE_SCRATCH], "sampled-token draw",
                          levels=("avx512", "avx2"))
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py


def available(at: str | None) -> bool:
    """Whether the kernel runs at level `at`."""
    return _LIBRARY.unchecked(_SAMPLE.symbol, at) is not None


def sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                min_p: list[float], u: torch.Tensor, at: str) -> torch.Tensor:
    """Each row's token [B] int64 from logits [B, V] fp32 (a CPU's), with its temperature (> 0), top-k (0: off),
    top-p (>= 1: off), min-p (0: off) and uniform u [B] in [0, 1)."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if not (rows >= 0 and logits.shape[1] > 0 and _SAMPLE.accepts(logits=logits)) or u.shape != (rows,):
        raise ValueError(f"sample_rows: takes contiguous CPU fp32 logits [B, V] and u [B], not {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}, u {tuple(u.shape)}")
    if not all(len(column) == rows for column in (temperature, top_k, top_p, min_p)):
        raise ValueError(f"sample_rows: one temperature, top_k, top_p and min_p per row ({rows})")
    if any(not t > 0 for t in temperature):
        raise ValueError(f"sample_rows: temperatures must be positive, got {temperature}")
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _LIBRARY.unchecked(_SAMPLE.symbol, at)(
            logits, rows, logits.shape[1], torch.tensor(temperature, dtype=torch.float32),
            torch.tensor(top_k, dtype=torch.int64), torch.tensor(top_p, dtype=torch.float32),
            torch.tensor(min_p, dtype=torch.float32), u.to(torch.float64).contiguous(), out)
    return out
