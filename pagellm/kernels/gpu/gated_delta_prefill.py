"""Gated DeltaNet prefill on CUDA in Triton: the gated delta rule over every prefill request of a step in one
launch, chunked as FLA's algorithm (the WY / UT form of kernels/reference/gated_delta.chunked_gated_delta), each
request's state read from and written to its slot in place, and snapshot rows written at given boundaries.

Why our own and not fla-core's `chunk_gated_delta_rule`: that one takes a batch's initial states as a dense
[N, H, dk, dv] tensor and returns the final ones, so each chunk of a step would gather and scatter every state,
and it cannot stop at the block boundaries prefix caching snapshots (nor at a verify step's drafts). Which is
faster on a device is the device check's question (bench/device_delta.py times both where fla-core imports).

One program per (request, value head, BLOCK_V value columns) walks its request's chunks in order, with the
state [dk, BLOCK_V] in registers:
    γ = cumsum(g) in the chunk, Γ_ij = e^{γ_i - γ_j} (i >= j), A = strict_lower(β K Kᵀ ⊙ Γ), T = (I + A)^-1
    U = T (β V), W = T (β e^γ K), V' = U - W S
    O = (e^γ Q) S + (Q Kᵀ ⊙ Γ) V',  S = e^{γ_last} S + (e^{γ_last - γ} K)ᵀ V'
T comes from forward substitution inside blocks of 16 rows, joined by products (`_unit_lower_inverse`). A chunk's
rows past its length load as zeros and contribute nothing (a verify step's one-token chunks substitute nothing).

Import only where Triton kernels are wanted (kernels/gpu/layer_ops.py says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.gpu.gated_delta import not_rule_inputs, stored_state
from pagellm.kernels.reference.gated_delta import CHUNK_SIZE, PrefillSequence

STATE_BLOCK_V = 32  # value columns of one head's state a program holds: [dk, 32] fp32
# fp32 products on tensor cores in three tf32 passes: about fp32's accuracy (the rule's oracle is fp32)
DOT_PRECISION = "tf32x3"


@triton.jit
def _unit_lower_inverse(a, rows, n, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for A [CHUNK, CHUNK] strictly lower (rows from n on zero). The diagonal blocks of SUB rows by
    forward substitution, all blocks at once (D); then with N = D A_off (A below those blocks), nilpotent of
    degree CHUNK / SUB = 4: (I + A)^-1 = (I + N)^-1 D = (I - N)(I + N²) D, four products on tensor cores."""
    SUB: tl.constexpr = CHUNK // 4
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    same = (rows // SUB)[:, None] == (rows // SUB)[None, :]
    d = eye
    for i in range(1, tl.minimum(n, SUB)):  # row i of each block: d_r <- e_r - sum_j a_rj d_j over its block
        d -= tl.dot(tl.where(same & (rows % SUB == i)[:, None], a, 0.0), d, input_precision=PRECISION)
    nil = tl.dot(d, tl.where(same, 0.0, a), input_precision=PRECISION)
    twice = tl.dot(eye - nil, eye + tl.dot(nil, nil, input_precision=PRECISION), input_precision=PRECISION)
    return tl.dot(twice, d, input_precision=PRECISION)


@triton.jit
def _chunked_rule_kernel(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                         seq_slot_ptr, seq_fresh_ptr, seq_chunks_ptr, chunk_start_ptr, chunk_len_ptr, chunk_row_ptr,
                         GROUP, s_state_slot, s_state_head, s_q, s_qh, s_v, s_vh, s_g, s_out, s_outh,
                         DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, CHUNK)
    k_ok, v_ok = kk < DK, vv < DV
    ok = k_ok[:, None] & v_ok[None, :]
    head = h // GROUP  # the key head this value head reads
    cells = h * s_state_head + kk[:, None] * DV + vv[None, :]  # [BLOCK_K, BLOCK_V] within a state row
    slot_cells = state_ptr + tl.load(seq_slot_ptr + seq).to(tl.int64) * s_state_slot + cells
    stale = tl.full([BLOCK_K, BLOCK_V], tl.load(seq_fresh_ptr + seq), tl.int64) == 0
    # a fresh request starts from zeros: its slot is not read; a bf16 state is widened, the rule runs in fp32
    s = tl.load(slot_cells, mask=ok & stale, other=0.0).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    for c in range(tl.load(seq_chunks_ptr + seq), tl.load(seq_chunks_ptr + seq + 1)):
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        n = tl.load(chunk_len_ptr + c)
        live = rows < n
        tok = start + rows
        qk_cells = tok[:, None] * s_q + head * s_qh + kk[None, :]
        qk_ok = live[:, None] & k_ok[None, :]
        k = tl.load(k_ptr + qk_cells, mask=qk_ok, other=0.0)  # [CHUNK, BLOCK_K]
        v = tl.load(v_ptr + tok[:, None] * s_v + h * s_vh + vv[None, :], mask=live[:, None] & v_ok[None, :],
                    other=0.0)  # [CHUNK, BLOCK_V]
        g = tl.load(g_ptr + tok * s_g + h, mask=live, other=0.0)
        beta = tl.load(beta_ptr + tok * s_g + h, mask=live, other=0.0)
        gamma = tl.cumsum(g, axis=0)  # [CHUNK]; rows past n repeat the last (g loads as 0)
        # masked before exp: above the diagonal γ_i - γ_j > 0 and could overflow
        decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        a = tl.where(strict, beta[:, None] * tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        t = _unit_lower_inverse(a, rows, n, CHUNK, PRECISION)
        up = tl.exp(gamma)
        u = tl.dot(t, v * beta[:, None], input_precision=PRECISION)  # [CHUNK, BLOCK_V]
        w = tl.dot(t, k * (beta * up)[:, None], input_precision=PRECISION)  # [CHUNK, BLOCK_K]
        v_new = u - tl.dot(w, s, input_precision=PRECISION)
        q = tl.load(q_ptr + qk_cells, mask=qk_ok, other=0.0)  # loaded once T, A and W are spent: fewer registers
        attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay  # causal, diagonal included
        o = tl.dot(q * up[:, None], s, input_precision=PRECISION) + tl.dot(attn, v_new, input_precision=PRECISION)
        tl.store(out_ptr + tok[:, None] * s_out + h * s_outh + vv[None, :], o, mask=live[:, None] & v_ok[None, :])
        last = tl.sum(tl.where(rows == n - 1, gamma, 0.0), axis=0)
        k_decayed = k * tl.exp(last - gamma)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PRECISION)
        snapshot = tl.load(chunk_row_ptr + c)
        if snapshot >= 0:  # a block boundary (or a draft) ends here: the state after it, to its row
            kept = stored_state(s, state_ptr)
            tl.store(state_ptr + snapshot.to(tl.int64) * s_state_slot + cells, kept, mask=ok)
            s = kept.to(tl.float32)  # on from what a request resumed from the row reads (a bf16 state: rounded)
    tl.store(slot_cells, stored_state(s, state_ptr), mask=ok)  # a bf16 state rounded once, at the end


def chunk_table(sequences: list[PrefillSequence], chunk: int = CHUNK_SIZE) -> tuple[list[int], ...]:
    """The launch's host tables: per request its slot, whether fresh, and its first chunk (plus one past the last);
    per chunk its first token, its length and the row its final state is copied to (-1: none). A request's tokens
    are cut at its snapshot boundaries, then every `chunk` tokens (a remainder is one shorter chunk)."""
    slots, fresh, firsts, starts, lengths, rows = [], [], [0], [], [], []
    for seq in sequences:
        ends = [end for end, _ in seq.snapshots]
        if seq.length < 1 or ends != sorted(set(ends)) or not all(0 < end <= seq.length for end in ends):
            raise ValueError(f"snapshot boundaries {ends} are not ascending within a request's 1..{seq.length} "
                             f"tokens")
        lo = 0
        for end, row in (*seq.snapshots, (seq.length, -1)):
            for first in range(lo, end, chunk):
                starts.append(seq.start + first)
                lengths.append(min(chunk, end - first))
                rows.append(-1)
            if end > lo:
                rows[-1] = row
            lo = end
        slots.append(seq.slot)
        fresh.append(int(seq.fresh))
        firsts.append(len(starts))
    return slots, fresh, firsts, starts, lengths, rows


def rule_prefill_(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, sequences: list[PrefillSequence], block_v: int = STATE_BLOCK_V,
                  precision: str = DOT_PRECISION, num_warps: int = 4) -> torch.Tensor:
    """The rule over each request's tokens from its slot's state (zeros when fresh), the slots and snapshot rows
    written in place -> out [T, Hv, dv] fp32. state [S, Hv, dk, dv] fp32 or bf16 (computed in fp32); q, k [T, Hk,
    dk] fp32 (l2-normalised, q scaled), value head h reading key head h // (Hv / Hk); v [T, Hv, dv], g, beta [T, Hv]
    fp32; the requests' token ranges (`start`, `length`) index T. block_v, precision, num_warps: the launch's tile
    (the device check times others)."""
    _, v_heads, dk, dv = state.shape
    tokens, k_heads = q.shape[:2]
    if not_rule_inputs(state, q, k, v, g, beta):
        raise ValueError("rule_prefill_: q, k, v, g and beta must be contiguous fp32, the state contiguous fp32 or "
                         "bf16")
    out = torch.zeros(tokens, v_heads, dv, dtype=torch.float32, device=q.device)
    if not sequences:
        return out
    slots, fresh, firsts, starts, lengths, rows = chunk_table(sequences)
    table = torch.tensor([*slots, *fresh, *firsts, *starts, *lengths, *rows], dtype=torch.int64)
    table = table.to(q.device).split([len(slots), len(fresh), len(firsts), len(starts), len(lengths), len(rows)])
    block_v = max(16, min(block_v, triton.next_power_of_2(dv)))
    _chunked_rule_kernel[(len(sequences), v_heads, triton.cdiv(dv, block_v))](
        state, q, k, v, g, beta, out, *table, v_heads // k_heads, state.stride(0), state.stride(1),
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
        DK=dk, DV=dv, CHUNK=CHUNK_SIZE, BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v,
        PRECISION=precision, num_warps=num_warps)
    return out
