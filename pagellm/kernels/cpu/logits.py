"""Logits soft-capping + fp32 conversion, and greedy argmax, through C++ kernels (csrc/logits.cpp).

Why: at V = 262144 the torch chain after the LM head of a batched decode step
(`tanh(logits / cap) * cap` in bf16, `.float()` into a fresh tensor, `argmax(dim=-1)`)
costs tens of ms on CPU. The caller chooses once, from its level, between these and the torch
expressions (kernels/ops.py for the model's logits, runner/sampler.py for argmax and the grammar
masks); given inputs they do not take they raise. The torch expressions stay the oracle the
kernels are tested against (tests/kernels/test_logits_kernels.py).
"""

from __future__ import annotations

import torch

from pagellm.kernels.transfers import to_device

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import FLOATS, DtypeCode, Float, Function, Int, Tensor

_TO_F32 = Function("pagellm_logits_to_f32", (
    Tensor("logits", FLOATS), DtypeCode("logits"), Int("rows"), Int("V"), Float("cap"),
    Tensor("out", (torch.float32,))))
_ARGMAX = Function("pagellm_argmax_rows", (Tensor("x", (torch.float32,)), Int("rows"), Int("V"),
                                           Tensor("out", (torch.int64,))))
_MASK = Function("pagellm_mask_rows", (Tensor("logits", (torch.float32,)), Int("V"), Tensor("bitmask", (torch.int32,)),
                                       Int("words"), Tensor("rows", (torch.int64,)), Int("count")))
_LIBRARY = native.Library("logits", [_TO_F32, _ARGMAX, _MASK], "logits epilogue")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py
_SYMBOLS = {"logits_to_f32": _TO_F32.symbol, "argmax_rows": _ARGMAX.symbol, "mask_rows": _MASK.symbol}


def _kernel(name: str, at: str | None):
    """A function of csrc/logits.cpp at level `at` (unchecked caller), or None."""
    return _LIBRARY.unchecked(_SYMBOLS[name], at)


def available(name: str, at: str | None) -> bool:
    """Whether csrc/logits.cpp's `name` (logits_to_f32, argmax_rows, mask_rows) runs at level `at`."""
    return _kernel(name, at) is not None


def _handled(function: Function, x: torch.Tensor) -> bool:
    return x.dim() >= 1 and x.shape[-1] > 0 and function.accepts(**{function.params[0]: x})


def _check_out(out: torch.Tensor, logits: torch.Tensor) -> None:
    # A wrong buffer is the caller's bug, not an input to hand back to torch: say so.
    if (out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != logits.shape
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous CPU fp32 tensor of shape {tuple(logits.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})")


def logits_to_f32(logits: torch.Tensor, cap: float | None, at: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`(torch.tanh(logits / cap) * cap).float()` (or `logits.float()` when cap is None or <= 0).

    The soft-capping rounds as torch does in logits' dtype: bit-identical for bf16, within a
    few ulp for fp32. `out` (fp32, logits' shape, contiguous): written and returned, so a
    buffer reused across steps spares the page faults of a fresh [B, V] tensor; it may be
    `logits` itself when that is fp32 (in place), but must not otherwise overlap it.
    Without `out`, fp32 logits with no cap are returned as they are (as `.float()` does). A plan binds it where
    the level has it and the model's dtype is one it takes (kernels/ops.py): other logits are a ValueError.
    """
    if not _handled(_TO_F32, logits):
        raise ValueError(f"logits_to_f32: takes contiguous CPU fp32/bf16 logits of at least one column, not "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    if out is not None:
        _check_out(out, logits)
    capped = cap is not None and cap > 0
    if out is None and logits.dtype == torch.float32 and not capped:
        return logits
    fn = _kernel("logits_to_f32", at)
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32)
    if out.data_ptr() == logits.data_ptr() and not capped:
        return out  # fp32 in place with nothing to do
    V = logits.shape[-1]
    fn(logits, logits.numel() // V, V, float(cap) if capped else 0.0, out)
    return out


def argmax_rows(x: torch.Tensor, at: str) -> torch.Tensor:
    """`x.argmax(dim=-1)` for fp32 x: the first index of each row's maximum, a NaN counting as
    the maximum (the first NaN wins), as torch's CPU argmax. int64, shape x.shape[:-1].
    """
    x = x.contiguous()
    if not _handled(_ARGMAX, x):  # torch raises on an empty reduction too
        raise ValueError(f"argmax_rows: takes CPU fp32 rows of at least one column, not {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    fn = _kernel("argmax_rows", at)
    V = x.shape[-1]
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    if out.numel():
        fn(x, x.numel() // V, V, out)
    return out


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], at: str) -> None:
    """In place: logits[rows[j], t] = -inf wherever bit t % 32 of bitmask[j, t // 32] is 0 (a grammar's packed
    allowed-token mask, xgrammar's layout). logits [B, V] fp32, bitmask [len(rows), ceil(V / 32)] int32."""
    if not (logits.dim() == 2 and _handled(_MASK, logits) and _MASK.accepts(bitmask=bitmask)):
        raise ValueError(f"mask_rows: takes contiguous CPU fp32 logits [B, V] and an int32 bitmask, not "
                         f"{logits.dtype} {tuple(logits.shape)}, {bitmask.dtype} on {logits.device}")
    if not rows:
        return
    fn = _kernel("mask_rows", at)
    V = logits.shape[-1]
    fn(logits, V, bitmask, bitmask.shape[1], torch.tensor(rows, dtype=torch.int64), len(rows))


def mask_rows_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The oracle, and the path without the kernel (another device, no level): unpack the bits into a
    [len(rows), V] bool tensor."""
    if not rows:
        return
    V = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :V].bool().to(logits.device)
    index = to_device(rows, torch.int64, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
