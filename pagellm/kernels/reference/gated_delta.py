"""The gated delta rule (Gated DeltaNet linear attention), torch reference kernels, fp32.

Legend: L = tokens of one sequence, H = value heads (q/k already repeated to the
value heads), dk / dv = key / value head dims, N = H (or B * H for a batch).

State S [H, dk, dv] per sequence. Per token, with q already l2-normalised and
scaled by dk^-0.5 and k l2-normalised:

    S <- e^{g_t} S                    (g_t <= 0: decay)
    delta = beta_t (v_t - Sᵀ k_t)      (the delta rule: write only what S mispredicts)
    S <- S + k_t deltaᵀ
    o_t = Sᵀ q_t                       (read after the update)

`recurrent_gated_delta_` runs that loop; `chunked_gated_delta` computes the same
thing 64 tokens at a time with matmuls (the WY / UT-transform form; a remainder
shorter than 64 is one shorter chunk, not padded). Both take the state
explicitly so callers decide where it lives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK_SIZE = 64


class PrefillSequence(NamedTuple):
    """One request of a batched prefill (kernels/gpu/gated_delta_prefill.py): its tokens' rows in the step's packed
    inputs, its state slot, whether it starts from zero state (its slot then only written), and the rows its
    state is copied to after given numbers of its tokens (ascending, each in 1..length)."""

    start: int
    length: int
    slot: int
    fresh: bool
    snapshots: tuple[tuple[int, int], ...] = ()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / HF form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] (any dtype) -> fp32 [..., H, dk] per value head: l2-normalised, q scaled by dk^-0.5.

    Value head h reads key head h // (H / Hk), i.e. heads are repeated in place.
    """
    repeat = num_v_heads // q.shape[-2]
    q, k = q.float(), k.float()
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def gated_delta_step_(
    state: torch.Tensor,  # [N, dk, dv] fp32, updated in place
    q: torch.Tensor,  # [N, dk]
    k: torch.Tensor,  # [N, dk]
    v: torch.Tensor,  # [N, dv]
    g: torch.Tensor,  # [N]
    beta: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, dv]
    """One token of the rule for N independent (sequence, head) states, in place.

    The state is read once (kᵀS and qᵀS in one bmm) and updated with two in-place
    passes (scale, rank-1 add). The output uses o = (S')ᵀq = e^g Sᵀq + (k·q) delta,
    which equals reading S' after the update without a third pass over it.
    """
    decay = g.exp()  # [N]
    read = torch.bmm(torch.stack((k, q), dim=1), state)  # [N, 2, dv]: kᵀS, qᵀS
    delta = beta[:, None] * (v - decay[:, None] * read[:, 0])  # [N, dv]
    out = decay[:, None] * read[:, 1] + (k * q).sum(-1, keepdim=True) * delta
    state.mul_(decay[:, None, None]).baddbmm_(k[:, :, None], delta[:, None, :])
    return out


def recurrent_gated_delta_(
    q: torch.Tensor,  # [L, H, dk] fp32
    k: torch.Tensor,  # [L, H, dk]
    v: torch.Tensor,  # [L, H, dv]
    g: torch.Tensor,  # [L, H]
    beta: torch.Tensor,  # [L, H]
    state: torch.Tensor,  # [H, dk, dv] fp32, updated in place
) -> torch.Tensor:  # [L, H, dv]
    """Token by token; the state (e.g. a view of a request's slot) is updated in place."""
    out = v.new_empty(v.shape, dtype=torch.float32)
    v = v.float()
    for t in range(q.shape[0]):
        out[t] = gated_delta_step_(state, q[t], k[t], v[t], g[t], beta[t])
    return out


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[L, H, ...] (L a multiple of chunk) -> [H, L/chunk, chunk, ...] fp32."""
    x = x.float().transpose(0, 1)  # [H, L, ...]
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def chunked_gated_delta(
    q: torch.Tensor,  # [L, H, dk] fp32
    k: torch.Tensor,  # [L, H, dk]
    v: torch.Tensor,  # [L, H, dv]
    g: torch.Tensor,  # [L, H]
    beta: torch.Tensor,  # [L, H]
    state: torch.Tensor,  # [H, dk, dv] fp32 initial state (not modified)
    chunk: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [L, H, dv] fp32, final state [H, dk, dv]
    """The rule over whole chunks of `chunk` tokens, then the remainder as one shorter chunk.

    (The remainder is not padded to a full chunk: a chunk of any size is exact, and
    for short prefills the padding would cost more than the tokens themselves.)
    """
    length = q.shape[0]
    whole = length - length % chunk
    outs = []
    for lo, hi, size in ((0, whole, chunk), (whole, length, length - whole)):
        if hi > lo:
            out, state = _chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, size)
            outs.append(out)
    return (torch.cat(outs) if len(outs) > 1 else outs[0]), state


def _chunked(q, k, v, g, beta, state, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked_gated_delta for L a multiple of `chunk`.

    With γ = cumsum(g) inside a chunk and Γ_ij = e^{γ_i - γ_j} (i >= j, else 0):
        A = strict_lower(diag(β) K Kᵀ ⊙ Γ),  T = (I + A)^-1  (unit lower-triangular solve)
        U = T (β ⊙ V),  W = T (β e^γ ⊙ K)
    then per chunk, in order:
        V' = U - W S;  O = (e^γ ⊙ Q) S + (Q Kᵀ ⊙ Γ) V';  S = e^{γ_C} S + (e^{γ_C - γ} ⊙ K)ᵀ V'.
    """
    dv = v.shape[-1]
    qc, kc, vc = _to_chunks(q, chunk), _to_chunks(k, chunk), _to_chunks(v, chunk)  # [H, n, C, d]
    gc, bc = _to_chunks(g, chunk), _to_chunks(beta, chunk)  # [H, n, C]
    gamma = gc.cumsum(-1)  # [H, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # i >= j
    # Mask before exp: above the diagonal γ_i - γ_j > 0 and could overflow.
    big_gamma = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, n, C, C]
    k_beta = kc * bc[..., None]
    # solve_triangular with unitriangular=True reads only the strictly lower part: (I + A).
    # U and W share the system: one solve over [β V | β e^γ K].
    system = (k_beta @ kc.transpose(-1, -2)) * big_gamma
    rhs = torch.cat([vc * bc[..., None], k_beta * gamma.exp()[..., None]], dim=-1)  # [H, n, C, dv + dk]
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, kc.shape[-1]], -1)
    attn = (qc @ kc.transpose(-1, -2)) * big_gamma  # [H, n, C, C], causal incl. diagonal
    q_decayed = qc * gamma.exp()[..., None]
    k_decayed = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(u)  # [H, n, C, dv]
    s = state.float()
    for i in range(qc.shape[1]):
        v_new = u[:, i] - w[:, i] @ s  # [H, C, dv]
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], -1, dv).transpose(0, 1), s
