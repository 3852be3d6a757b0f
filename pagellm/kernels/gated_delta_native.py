"""Gated DeltaNet decode through the C++ kernel (csrc/gated_delta_decode.cpp), in place by slot.

Both functions update the bound state tensors ([S, ...], all slots) directly at
the rows named by `slots`: no gather of the batch's states into a copy and no
write-back. Each returns None when the inputs are not ones the kernel handles
(not on CPU, unsupported dtype, not contiguous, native kernels unavailable) and
has then touched nothing; the caller runs the torch reference
(GatedDeltaNet._decode_torch), which stays the oracle the kernel is tested against.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels import native

_DTYPE_FLAG = native.DTYPE_CODES

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "conv": ("pagellm_gdn_conv_decode", [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "rule": ("pagellm_gdn_rule_decode", [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]),
}


_LIBRARY = native.Library("gated_delta_decode",
                          {symbol: (argtypes, None) for symbol, argtypes in _SIGNATURES.values()})


def _kernel(which: str):
    """A function of csrc/gated_delta_decode.cpp at the selected level, or None."""
    return _LIBRARY.function(_SIGNATURES[which][0])


def _on_cpu_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _slots_ok(slots: torch.Tensor, num_slots: int) -> bool:
    # The kernel indexes raw memory by slot: an out-of-range slot would write outside the tensor.
    return (slots.dtype == torch.int64 and slots.dim() == 1 and _on_cpu_contiguous(slots)
            and (slots.numel() == 0 or (int(slots.min()) >= 0 and int(slots.max()) < num_slots)))


def decode_handled(conv_state: torch.Tensor, recurrent_state: torch.Tensor, x: torch.Tensor,
                   weight: torch.Tensor, slots: list[int]) -> bool:
    """Whether both kernels take this decode step (checked before either touches a state)."""
    return (x.dtype in _DTYPE_FLAG and conv_state.dtype == weight.dtype == x.dtype
            and recurrent_state.dtype == torch.float32 and _on_cpu_contiguous(conv_state, recurrent_state, weight)
            and x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad)
            and bool(slots) and 0 <= min(slots) and max(slots) < min(conv_state.shape[0], recurrent_state.shape[0])
            and _kernel("conv") is not None and _kernel("rule") is not None)


def slot_index_usable(index: torch.Tensor | None, count: int) -> bool:
    """Whether a given slot tensor can be passed to the kernels as is (else one is built from the list)."""
    return index is not None and index.numel() == count and index.dtype == torch.int64 and \
        _on_cpu_contiguous(index)


def conv_decode_(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor) -> torch.Tensor | None:
    """conv_state [S, C, K-1] (in place), slots [B] int64, x [B, C], weight [C, K] -> silu(conv) [B, C].

    All of conv_state, x, weight in one dtype (fp32 or bf16). None: not handled.
    """
    if (x.dtype not in _DTYPE_FLAG or not conv_state.dtype == weight.dtype == x.dtype
            or not _on_cpu_contiguous(conv_state, x, weight) or not _slots_ok(slots, conv_state.shape[0])):
        return None
    fn = _kernel("conv")
    if fn is None:
        return None
    batch, channels = x.shape
    out = torch.empty_like(x)
    fn(conv_state.data_ptr(), slots.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(),
       batch, channels, weight.shape[1], _DTYPE_FLAG[x.dtype])
    return out


def rule_decode_(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """One token of the gated delta rule on state[slots[b], h] in place -> out [B, Hv, dv] fp32.

    state [S, Hv, dk, dv] fp32; q, k [B, Hk, dk] fp32, already l2-normalised (q scaled), one
    per key head (value head h reads key head h // (Hv / Hk)); v [B, Hv, dv], g, beta [B, Hv]
    fp32. None: not handled.
    """
    tensors = (state, q, k, v, g, beta)
    if (any(t.dtype != torch.float32 for t in tensors) or not _on_cpu_contiguous(*tensors)
            or not _slots_ok(slots, state.shape[0])):
        return None
    fn = _kernel("rule")
    if fn is None:
        return None
    _, v_heads, dk, dv = state.shape
    batch, k_heads = q.shape[:2]
    out = torch.empty(batch, v_heads, dv, dtype=torch.float32)
    fn(state.data_ptr(), slots.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
       out.data_ptr(), batch, k_heads, v_heads, dk, dv)
    return out
