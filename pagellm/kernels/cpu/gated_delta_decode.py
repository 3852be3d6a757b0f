"""Gated DeltaNet decode through the C++ kernel (csrc/gated_delta_decode.cpp), in place by slot.

Both functions update the bound state tensors ([S, ...], all slots) directly at
the rows named by `slots`: no gather of the batch's states into a copy and no
write-back. A plan binds them where the level has them and the model's dtype is one they take (kernels/ops.py);
`check_decode` refuses a step either would not take before one touches a state (ValueError, IndexError for a slot
outside the states). The torch reference (GatedDeltaNet._decode_torch) stays the oracle they are tested against.
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import FLOATS, DtypeCode, Function, Int, Tensor
from pagellm.kernels.cpu.layer_ops import refuse

_F32, _SLOTS = (torch.float32,), (torch.int64,)
_CONV = Function("pagellm_gdn_conv_decode", (
    Tensor("conv_state", FLOATS), Tensor("slots", _SLOTS), Tensor("x", FLOATS), Tensor("weight", FLOATS),
    Tensor("out", FLOATS), Int("batch"), Int("channels"), Int("taps"), DtypeCode("x")))
_RULE = Function("pagellm_gdn_rule_decode", (
    Tensor("state", FLOATS), Tensor("slots", _SLOTS),
    *(Tensor(name, _F32) for name in ("q", "k", "v", "g", "beta", "out")),
    Int("batch"), Int("k_heads"), Int("v_heads"), Int("dk"), Int("dv"), DtypeCode("state")))
_LIBRARY = native.Library("gated_delta_decode", [_CONV, _RULE], "Gated DeltaNet decode")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py
_SYMBOLS = {"conv": _CONV.symbol, "rule": _RULE.symbol}


def _kernel(which: str, at: str | None):
    """A function of csrc/gated_delta_decode.cpp at level `at` (unchecked caller), or None."""
    return _LIBRARY.unchecked(_SYMBOLS[which], at)


def available(at: str | None) -> bool:
    """Whether both decode kernels run at level `at`."""
    return _kernel("conv", at) is not None and _kernel("rule", at) is not None


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    # The kernel indexes raw memory by slot: an out-of-range slot would write outside the tensor.
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise IndexError(f"a state slot of {slots.tolist()} is outside the {num_slots} slots")


def check_decode(conv_state: torch.Tensor, recurrent_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 slots: list[int]) -> None:
    """Raises unless both kernels take this decode step: checked before either touches a state."""
    if not (_CONV.accepts(conv_state=conv_state, x=x, weight=weight) and _RULE.accepts(state=recurrent_state)
            and conv_state.dtype == weight.dtype == x.dtype and slots):
        raise refuse("gated delta decode", f"conv state {conv_state.dtype}, x {x.dtype}, weight {weight.dtype}, "
                                           f"state {recurrent_state.dtype}, {len(slots)} slots")
    num_slots = min(conv_state.shape[0], recurrent_state.shape[0])
    if min(slots) < 0 or max(slots) >= num_slots:
        raise IndexError(f"a state slot of {slots} is outside the {num_slots} slots")


def conv_decode_(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, at: str) -> torch.Tensor:
    """conv_state [S, C, K-1] (in place), slots [B] int64, x [B, C], weight [C, K] -> silu(conv) [B, C].

    All of conv_state, x, weight in one dtype (fp32 or bf16).
    """
    if (not _CONV.accepts(conv_state=conv_state, x=x, weight=weight, slots=slots) or slots.dim() != 1
            or not conv_state.dtype == weight.dtype == x.dtype):
        raise refuse("conv_decode_", f"conv state {conv_state.dtype}, x {x.dtype}, weight {weight.dtype}")
    _check_slots(slots, conv_state.shape[0])
    batch, channels = x.shape
    out = torch.empty_like(x)
    _kernel("conv", at)(conv_state, slots, x, weight, out, batch, channels, weight.shape[1])
    return out


def rule_decode_(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor, at: str) -> torch.Tensor:
    """One token of the gated delta rule on state[slots[b], h] in place -> out [B, Hv, dv] fp32.

    state [S, Hv, dk, dv] fp32 or bf16 (computed in fp32, rounded once when written back); q, k [B, Hk, dk]
    fp32, already l2-normalised (q scaled), one per key head (value head h reads key head h // (Hv / Hk));
    v [B, Hv, dv], g, beta [B, Hv] fp32.
    """
    if not _RULE.accepts(state=state, q=q, k=k, v=v, g=g, beta=beta, slots=slots) or slots.dim() != 1:
        raise refuse("rule_decode_", f"state {state.dtype}, q {q.dtype}, v {v.dtype}")
    _check_slots(slots, state.shape[0])
    _, v_heads, dk, dv = state.shape
    batch, k_heads = q.shape[:2]
    out = torch.empty(batch, v_heads, dv, dtype=torch.float32)
    _kernel("rule", at)(state, slots, q, k, v, g, beta, out, batch, k_heads, v_heads, dk, dv)
    return out
