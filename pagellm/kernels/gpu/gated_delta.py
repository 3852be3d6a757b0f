"""Gated DeltaNet decode on CUDA in Triton: the causal conv's update and the gated delta rule, each request's
state read and written in place at its slot (the contract of kernels/cpu/gated_delta_decode.py, whose torch
reference, GatedDeltaNet._decode_torch, is the oracle).

Why: the torch reference gathers the batch's states, runs about ten ops per layer and writes them back; vLLM's
fused recurrent kernel (FLA's, with state indices) reads each state once. A negative slot is a padded row of a
captured decode step: nothing is read or written for it, and its output is zero.

Import only where Triton kernels are wanted (kernels/gpu/layer_ops.py says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONV_BLOCK = 128  # channels a conv program updates
COPY_BLOCK = 1024  # elements of a state row a copy program moves
STATE_BLOCK_V = 32  # value columns of one head's state a rule program holds: [dk, 32] fp32 in registers
STATE_DTYPES = (torch.float32, torch.bfloat16)  # the recurrent state's, read into fp32 and rounded back


@triton.jit
def stored_state(s, state_ptr):
    """s (fp32) as the state's dtype: a bf16 state rounded to nearest even by its bits, as torch and the CPU
    kernels round (a GPU's cast does too; the interpreter's truncates, and its tests check these bits)."""
    if state_ptr.dtype.element_ty == tl.bfloat16:
        bits = s.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # a NaN's add may carry into (or past) the sign
        half = tl.where(s != s, (bits >> 16) | 0x40, rounded)  # a NaN stays one (quiet), as torch keeps it
        return half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return s


@triton.jit
def _conv_decode_kernel(state_ptr, slots_ptr, x_ptr, w_ptr, out_ptr, C, s_state, s_x, s_out,
                        TAPS: tl.constexpr, BLOCK: tl.constexpr):
    """One request, BLOCK channels: out = silu(sum over taps of [state, x] * w), then state <- its last TAPS-1."""
    b, block = tl.program_id(0), tl.program_id(1)
    c = block * BLOCK + tl.arange(0, BLOCK)
    ok = c < C
    slot = tl.load(slots_ptr + b)
    dtype = out_ptr.dtype.element_ty
    if slot < 0:  # a padded row
        tl.store(out_ptr + b * s_out + c, tl.zeros([BLOCK], dtype=tl.float32).to(dtype), mask=ok)
    else:
        row = state_ptr + slot.to(tl.int64) * s_state + c * (TAPS - 1)  # [C, TAPS-1] per slot, channel-major
        x = tl.load(x_ptr + b * s_x + c, mask=ok, other=0.0)
        acc = x.to(tl.float32) * tl.load(w_ptr + c * TAPS + TAPS - 1, mask=ok, other=0.0).to(tl.float32)
        for t in tl.static_range(TAPS - 1):
            held = tl.load(row + t, mask=ok, other=0.0)
            acc += held.to(tl.float32) * tl.load(w_ptr + c * TAPS + t, mask=ok, other=0.0).to(tl.float32)
            if t > 0:
                tl.store(row + t - 1, held, mask=ok)  # shift left: the oldest input leaves
        tl.store(row + TAPS - 2, x.to(state_ptr.dtype.element_ty), mask=ok)
        conv = acc.to(dtype).to(tl.float32)  # rounded as conv1d rounds, then silu as torch's (fp32 inside)
        tl.store(out_ptr + b * s_out + c, (conv / (1.0 + tl.exp(-conv))).to(dtype), mask=ok)


@triton.jit
def _rule_decode_kernel(state_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                        HV, GROUP, s_state_slot, s_state_head, s_q, s_qh, s_v, s_vh, s_g, s_out, s_outh,
                        DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (request, value head, BLOCK_V value columns): S <- e^g S; delta = beta (v - Sᵀk); S <- S + k deltaᵀ;
    out = Sᵀq, the state read and written once."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < DK, vv < DV
    slot = tl.load(slots_ptr + b)
    if slot < 0:  # a padded row
        tl.store(out_ptr + b * s_out + h * s_outh + vv, tl.zeros([BLOCK_V], dtype=tl.float32), mask=v_ok)
    else:
        head = h // GROUP  # the key head this value head reads
        q = tl.load(q_ptr + b * s_q + head * s_qh + kk, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + b * s_q + head * s_qh + kk, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + b * s_v + h * s_vh + vv, mask=v_ok, other=0.0)
        decay = tl.exp(tl.load(g_ptr + b * s_g + h))
        beta = tl.load(beta_ptr + b * s_g + h)
        cells = state_ptr + slot.to(tl.int64) * s_state_slot + h * s_state_head + kk[:, None] * DV + vv[None, :]
        ok = k_ok[:, None] & v_ok[None, :]
        s = tl.load(cells, mask=ok, other=0.0).to(tl.float32) * decay  # [BLOCK_K, BLOCK_V] fp32, whatever is held
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BLOCK_V]
        s += k[:, None] * delta[None, :]
        tl.store(cells, stored_state(s, state_ptr), mask=ok)  # a bf16 state rounded once a step
        tl.store(out_ptr + b * s_out + h * s_outh + vv, tl.sum(s * q[:, None], axis=0), mask=v_ok)


@triton.jit
def _copy_rows_kernel(t_ptr, src_ptr, dst_ptr, n, stride, BLOCK: tl.constexpr):
    """Row dst[b] of t <- row src[b], BLOCK elements a program; nothing where either is negative."""
    b, block = tl.program_id(0), tl.program_id(1)
    src = tl.load(src_ptr + b)
    dst = tl.load(dst_ptr + b)
    if src >= 0:
        if dst >= 0:
            cols = block * BLOCK + tl.arange(0, BLOCK)
            ok = cols < n
            row = tl.load(t_ptr + src * stride + cols, mask=ok)
            tl.store(t_ptr + dst * stride + cols, row, mask=ok)


def copy_state_rows_(conv_state: torch.Tensor, recurrent_state: torch.Tensor, src: torch.Tensor,
                     dst: torch.Tensor) -> None:
    """Rows src[b] of both state tensors copied to rows dst[b] ([B] int64 each; a negative either side: nothing),
    from device tensors alone (a captured verify step's rollback rows)."""
    _slots_ok(src, dst.numel(), dst.device)
    _slots_ok(dst, src.numel(), src.device)
    for t in (conv_state, recurrent_state):
        if not t.is_contiguous():
            raise ValueError("copy_state_rows_: the state tensors must be contiguous")
        per_row = t[0].numel()
        if src.numel():
            _copy_rows_kernel[(src.numel(), triton.cdiv(per_row, COPY_BLOCK))](t, src, dst, per_row, t.stride(0),
                                                                               BLOCK=COPY_BLOCK)


def check_decode(conv_state: torch.Tensor, recurrent_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 slots: list[int]) -> None:
    """Raises unless both kernels take this decode step (before either touches a state): one dtype for the conv
    state, x and weight, an fp32 or bf16 recurrent state, every slot below the states' count (negative: padding)."""
    if not (conv_state.dtype == weight.dtype == x.dtype and recurrent_state.dtype in STATE_DTYPES and slots):
        raise ValueError(f"gated delta decode: conv state {conv_state.dtype}, x {x.dtype}, weight {weight.dtype}, "
                         f"state {recurrent_state.dtype}, {len(slots)} slots")
    num_slots = min(conv_state.shape[0], recurrent_state.shape[0])
    if max(slots) >= num_slots:
        raise IndexError(f"a state slot of {slots} is outside the {num_slots} slots")


def _slots_ok(slots: torch.Tensor, count: int, device: torch.device) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1 or slots.numel() != count or slots.device != device:
        raise ValueError(f"slots: a [{count}] int64 tensor on {device} is needed, got {slots.dtype} "
                         f"{list(slots.shape)} on {slots.device}")


def not_rule_inputs(state: torch.Tensor, *fp32: torch.Tensor) -> bool:
    """Whether the rule kernels refuse these: a state of STATE_DTYPES and the rest fp32, all contiguous, q and k
    (the first two of fp32) of one stride."""
    tensors = (state, *fp32)
    return (state.dtype not in STATE_DTYPES or any(t.dtype != torch.float32 for t in fp32)
            or not all(t.is_contiguous() for t in tensors) or fp32[0].stride() != fp32[1].stride())


def conv_decode_(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """conv_state [S, C, K-1] (in place), slots [B] int64 (negative: padding), x [B, C], weight [C, K] -> silu(conv)
    [B, C] in x's dtype."""
    batch, channels = x.shape
    _slots_ok(slots, batch, x.device)
    if not (conv_state.is_contiguous() and weight.is_contiguous() and x.stride(-1) == 1):
        raise ValueError("conv_decode_: the conv state and weight must be contiguous, x rows of unit stride")
    out = torch.empty_like(x)
    if batch:
        _conv_decode_kernel[(batch, triton.cdiv(channels, CONV_BLOCK))](
            conv_state, slots, x, weight, out, channels, conv_state.stride(0), x.stride(0), out.stride(0),
            TAPS=weight.shape[1], BLOCK=CONV_BLOCK)
    return out


def rule_decode_(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule on state[slots[b], h] in place -> out [B, Hv, dv] fp32. state [S, Hv, dk,
    dv] fp32 or bf16 (computed in fp32); q, k [B, Hk, dk] fp32 (l2-normalised, q scaled), value head h reading
    key head h // (Hv / Hk); v [B, Hv, dv], g, beta [B, Hv] fp32."""
    _, v_heads, dk, dv = state.shape
    batch, k_heads = q.shape[:2]
    _slots_ok(slots, batch, q.device)
    if not_rule_inputs(state, q, k, v, g, beta):
        raise ValueError("rule_decode_: q, k, v, g and beta must be contiguous fp32, the state contiguous fp32 or "
                         "bf16")
    out = torch.empty(batch, v_heads, dv, dtype=torch.float32, device=q.device)
    if batch:
        block_v = min(STATE_BLOCK_V, triton.next_power_of_2(dv))
        _rule_decode_kernel[(batch, v_heads, triton.cdiv(dv, block_v))](
            state, slots, q, k, v, g, beta, out, v_heads, v_heads // k_heads, state.stride(0), state.stride(1),
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
            DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)
    return out
