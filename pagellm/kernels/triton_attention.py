"""Paged attention for CUDA in Triton: one launch for a whole step (prefill chunks and decodes mixed), reading
K/V in place through the block table.

The design of vLLM's unified Triton attention (../shared/notes/gpu.md), written for our cache layout:

    grid (T // BLOCK_Q + B, H_kv)      an upper bound on the query tiles of all requests, from shapes alone,
                                       so a captured graph replays it for any mix of lengths
    program (tile, kv head)            finds its request by a binary search over query_start_loc, then
                                       attends BLOCK_Q of its tokens x the G query heads that share the kv head
                                       (GQA packed: one K/V load serves all G), tiles of TILE_N keys at a time,
                                       each key's row found through block_tables, online softmax in fp32

Causal mask, sliding window and logit soft-cap as the torch reference (kernels/attention.py), which stays the
oracle. Written against Triton 3.6 and 3.9 alike; tested on CPU under TRITON_INTERPRET=1 (fp32 only: the
interpreter has no bf16), not yet run on a GPU (`pagellm bench device-check` is the prepared run). Not here
yet: split-KV for long decodes.

Import this module only where Triton kernels are wanted: `triton.jit` reads TRITON_INTERPRET when the
module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.core.attention_metadata import AttentionMetadata

TILE_N = 32  # keys per inner tile: >= 16 (tl.dot's smallest operand on GPUs)


@triton.jit
def _find_request(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning global query tile `tile`: the last b with query_start_loc[b] // BLOCK_Q + b <= tile
    (request b's tiles start there: each request's tiles are counted as if it began on a tile boundary)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Not specialised on these: a value of 1 (or a multiple of 16) would compile another kernel mid-run, e.g. when
# the batch or the block table's width changes.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, soft_cap, window, num_seqs,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_blk, stride_k_pos, stride_k_h, stride_v_blk, stride_v_pos, stride_v_h, stride_bt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G  # rows of a tile: (query token, query head of this kv head)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:  # a spare tile of the upper-bound grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this step's

    rows = tl.arange(0, BLOCK_M)
    token = local * BLOCK_Q + rows // BLOCK_G  # [M] within the request's new tokens
    group = rows % BLOCK_G
    row_ok = (token < q_len) & (group < G)
    head = kv_head * G + group
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, D]
    q_pos = context + token  # [M] absolute positions

    last = tl.minimum(seq_len, context + (local + 1) * BLOCK_Q)  # keys past the tile's last token: masked
    first = 0
    if USE_WINDOW:
        first = tl.maximum(context + local * BLOCK_Q - window + 1, 0) // TILE * TILE
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(first, last, TILE):
        keys = start + tl.arange(0, TILE)  # [N] absolute positions
        key_ok = keys < seq_len
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        row = keys % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block[None, :] * stride_k_blk + row[None, :] * stride_k_pos
                    + kv_head * stride_k_h + dims[:, None],
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0).to(q.dtype)  # [D, N]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [M, N] fp32
        if USE_CAP:  # cap * tanh(s / cap), tanh through exp: tl has no tanh in every version we target
            scores = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / soft_cap) + 1.0))
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - keys[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_v_blk + row[:, None] * stride_v_pos
                    + kv_head * stride_v_h + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)  # [N, D]; past the end: not read
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention_triton(
    query: torch.Tensor,  # [T, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H_q, D]
    """The Triton kernel over one step; the same contract as kernels/attention.paged_attention_reference."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads or key_cache.shape != value_cache.shape:
        raise ValueError(f"query heads {num_heads} over {num_kv_heads} kv heads, K {tuple(key_cache.shape)} "
                         f"and V {tuple(value_cache.shape)}: not a GQA cache")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query, key_cache and value_cache need unit stride along the head dimension")
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    # 16 rows at least (tl.dot); a decode step has one token per request, so a taller tile would be padding
    block_m = max(16 if meta.is_pure_decode else 64, block_g)
    block_q = block_m // block_g
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](  # K/V in another dtype than the queries are converted as the kernel loads them
        out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale, logits_soft_cap or 1.0, sliding_window or 0, meta.num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], meta.block_tables.stride(0),
        G=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=meta.block_size, TILE=TILE_N,
        USE_CAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out
