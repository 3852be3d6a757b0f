"""Gated DeltaNet decode through the C++ kernel (csrc/gated_delta_decode.cpp), in place by slot.

Both functions update the bound state tensors ([S, ...], all slots) directly at
the rows named by `slots`: no gather of the batch's states into a copy and no
write-back. Each returns None when the inputs are not ones the kernel handles
(not on CPU, unsupported dtype, not contiguous, native kernels unavailable) and
has then touched nothing; the caller runs the torch reference
(GatedDeltaNet._decode_torch), which stays the oracle the kernel is tested against.
"""

from __future__ import annotations

import torch

from pagellm.kernels import native
from pagellm.kernels.binding import FLOATS, DtypeCode, Function, Int, Tensor

_F32, _SLOTS = (torch.float32,), (torch.int64,)
_CONV = Function("pagellm_gdn_conv_decode", (
    Tensor("conv_state", FLOATS), Tensor("slots", _SLOTS), Tensor("x", FLOATS), Tensor("weight", FLOATS),
    Tensor("out", FLOATS), Int("batch"), Int("channels"), Int("taps"), DtypeCode("x")))
_RULE = Function("pagellm_gdn_rule_decode", (
    Tensor("state", _F32), Tensor("slots", _SLOTS),
    *(Tensor(name, _F32) for name in ("q", "k", "v", "g", "beta", "out")),
    Int("batch"), Int("k_heads"), Int("v_heads"), Int("dk"), Int("dv")))
_LIBRARY = native.Library("gated_delta_decode", [_CONV, _RULE], "Gated DeltaNet decode")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py
_SYMBOLS = {"conv": _CONV.symbol, "rule": _RULE.symbol}


def _kernel(which: str, at: str | None):
    """A function of csrc/gated_delta_decode.cpp at level `at` (unchecked caller), or None."""
    return _LIBRARY.unchecked(_SYMBOLS[which], at)


def _slots_ok(function: Function, slots: torch.Tensor, num_slots: int) -> bool:
    # The kernel indexes raw memory by slot: an out-of-range slot would write outside the tensor.
    return (slots.dim() == 1 and function.accepts(slots=slots)
            and (slots.numel() == 0 or (int(slots.min()) >= 0 and int(slots.max()) < num_slots)))


def decode_handled(conv_state: torch.Tensor, recurrent_state: torch.Tensor, x: torch.Tensor,
                   weight: torch.Tensor, slots: list[int], at: str | None) -> bool:
    """Whether both kernels take this decode step (checked before either touches a state)."""
    return (_CONV.accepts(conv_state=conv_state, x=x, weight=weight) and _RULE.accepts(state=recurrent_state)
            and conv_state.dtype == weight.dtype == x.dtype and bool(slots) and 0 <= min(slots) and max(slots) < min(conv_state.shape[0], recurrent_state.shape[0])
            and _kernel("conv", at) is not None and _kernel("rule", at) is not None)


def slot_index_usable(index: torch.Tensor | None, count: int) -> bool:
    """Whether a given slot tensor can be passed to the kernels as is (else one is built from the list)."""
    return index is not None and index.numel() == count and _CONV.accepts(slots=index)


def conv_decode_(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, at: str | None) -> torch.Tensor | None:
    """conv_state [S, C, K-1] (in place), slots [B] int64, x [B, C], weight [C, K] -> silu(conv) [B, C].

    All of conv_state, x, weight in one dtype (fp32 or bf16). None: not handled.
    """
    if (not _CONV.accepts(conv_state=conv_state, x=x, weight=weight) or not conv_state.dtype == weight.dtype == x.dtype
            or not _slots_ok(_CONV, slots, conv_state.shape[0])):
        return None
    fn = _kernel("conv", at)
    if fn is None:
        return None
    batch, channels = x.shape
    out = torch.empty_like(x)
    fn(conv_state, slots, x, weight, out, batch, channels, weight.shape[1])
    return out


def rule_decode_(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor, at: str | None) -> torch.Tensor | None:
    """One token of the gated delta rule on state[slots[b], h] in place -> out [B, Hv, dv] fp32.

    state [S, Hv, dk, dv] fp32; q, k [B, Hk, dk] fp32, already l2-normalised (q scaled), one
    per key head (value head h reads key head h // (Hv / Hk)); v [B, Hv, dv], g, beta [B, Hv]
    fp32. None: not handled.
    """
    if not _RULE.accepts(state=state, q=q, k=k, v=v, g=g, beta=beta) or not _slots_ok(_RULE, slots, state.shape[0]):
        return None
    fn = _kernel("rule", at)
    if fn is None:
        return None
    _, v_heads, dk, dv = state.shape
    batch, k_heads = q.shape[:2]
    out = torch.empty(batch, v_heads, dv, dtype=torch.float32)
    fn(state, slots, q, k, v, g, beta, out, batch, k_heads, v_heads, dk, dv)
    return out
