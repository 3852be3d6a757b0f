"""Paged attention for CUDA in Triton: one launch for a whole step (prefill chunks and decodes mixed), reading
K/V in place through the block table.

The design of vLLM's unified Triton attention (../shared/notes/gpu.md), written for our cache layout:

    grid (T // BLOCK_Q + B, H_kv, S)   an upper bound on the query tiles of all requests, from shapes alone,
                                       so a captured graph replays it for any mix of lengths
    program (tile, kv head)            finds its request by a binary search over query_start_loc, then
                                       attends BLOCK_Q of its tokens x the G query heads that share the kv head
                                       (GQA packed: one K/V load serves all G), tiles of TILE_N keys at a time,
                                       each key's row found through block_tables, online softmax in fp32

Causal mask, sliding window and logit soft-cap as the torch reference (kernels/reference/attention.py), which stays the
oracle. Written against Triton 3.6 and 3.9 alike; tested on CPU under TRITON_INTERPRET=1 (fp32 only: the
interpreter has no bf16), and on an H200 by `pagellm bench device-check`. Split-KV (vLLM's 3D decode): a decode
step with fewer (request, kv head) pairs than the GPU has multiprocessors, and a context of SPLIT_MIN_CONTEXT keys
or more, splits each context's keys into up to MAX_SPLITS runs, joined by _reduce_splits_kernel.

The launch is also registered as the torch custom op `torch.ops.pagellm.paged_attention` (it writes `out` in
place, a fake implementation gives torch.compile its shapes), for whatever compiles or captures a model (torch's
own tools, or the runner's CUDA graphs to come) to see one opaque op. pagellm's eager steps call the launch
directly: the dispatcher would add its Python overhead to every layer of a host-bound eager step.

Import this module only where Triton kernels are wanted: `triton.jit` reads TRITON_INTERPRET when the
module is imported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagellm.kernels.attention_metadata import AttentionMetadata

TILE_N = 32  # keys per inner tile: >= 16 (tl.dot's smallest operand on GPUs)
MAX_SPLITS = 16  # of one decode's keys (split-KV), as vLLM's 3D decode path bounds its segments
# Eager decode steps split only from this longest context up: below it the reduce launch and the partial buffers
# cost more than the split gains (measured on an H200: docs/benchmarks/2026-11-26-gpu-h200.md).
SPLIT_MIN_CONTEXT = 2048


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
    partial_ptr, max_sum_ptr, scale, soft_cap, window, num_seqs,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_blk, stride_k_pos, stride_k_h, stride_v_blk, stride_v_pos, stride_v_h, stride_bt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """NUM_SPLITS > 1 (decode): program (tile, kv head, split) attends one of NUM_SPLITS equal runs of the keys
    and stores its unnormalised output and (max, sum) of its softmax in partial / max_sum [T, H, S, ...] for
    _reduce_splits_kernel; NUM_SPLITS = 1 stores the output."""
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
    if NUM_SPLITS > 1:  # this program's run of whole key tiles; a run past the keys is empty
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(last - first, TILE), NUM_SPLITS) * TILE
        first = first + split * per_split
        last = tl.minimum(last, first + per_split)
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
    if NUM_SPLITS > 1:
        at = ((q_start + token) * (G * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [M] (token, head, split)
        _store_split(partial_ptr, max_sum_ptr, at, acc, m_i, l_i, row_ok, dims, BLOCK_D)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + token)[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _store_split(partial_ptr, max_sum_ptr, at, acc, m_i, l_i, row_ok, dims, BLOCK_D: tl.constexpr):
    """One split's unnormalised output [M, D] and its softmax's (max, sum) [M] at rows `at` of the partials."""
    tl.store(partial_ptr + at[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(max_sum_ptr + at * 2, m_i, mask=row_ok)
    tl.store(max_sum_ptr + at * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_splits_kernel(out_ptr, partial_ptr, max_sum_ptr, stride_o_t, stride_o_h, num_heads,
                          NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token, head): the splits' partial softmaxes joined, each rescaled to the largest max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    at = (token * num_heads + head) * NUM_SPLITS + splits  # [S]
    m = tl.load(max_sum_ptr + at * 2)
    l = tl.load(max_sum_ptr + at * 2 + 1)
    m_all = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all)))  # [S]
    total = tl.sum(l * weight, axis=0)
    acc = tl.sum(tl.load(partial_ptr + at[:, None] * BLOCK_D + dims[None, :]) * weight[:, None], axis=0)  # [D]
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Key splits of a decode step: enough programs to fill the GPU's `num_sms` multiprocessors twice over when
    (request, kv head) pairs alone would not, a power of two up to MAX_SPLITS; from shapes alone (a captured
    graph replays it for any context length)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(2 * num_sms, programs)))


def paged_attention_triton(
    query: torch.Tensor,  # [T, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [T, H_q, D]
    """The Triton kernel over one step; the same contract as kernels/attention.paged_attention_reference.
    num_splits: of each decode's keys (None: decode_splits for this GPU in a pure decode step captured for a graph
    or whose longest context reaches SPLIT_MIN_CONTEXT, else 1)."""
    num_tokens, num_heads, _ = query.shape
    num_kv_heads = key_cache.shape[2]
    block_g = triton.next_power_of_2(max(1, num_heads // num_kv_heads))  # shapes checked by _launch
    # 16 rows at least (tl.dot); a decode step has one token per request, so a taller tile would be padding
    block_m = max(16 if meta.is_pure_decode else 64, block_g)
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    if num_splits is None:
        # eager: split only where it pays (the reduce's launch costs the host more than short contexts gain);
        # a graph replays one choice for every context, and a replay launches the reduce at no host cost
        split = meta.is_pure_decode and (meta.for_graph or max(meta.seq_lens_host) >= SPLIT_MIN_CONTEXT)
        num_splits = decode_splits(meta.num_seqs, num_kv_heads, _multiprocessors(query.device)) if split else 1
    _launch(out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.num_seqs, meta.block_size, block_m, scale, sliding_window or 0, logits_soft_cap or 0.0, num_splits)
    return out


@torch.library.custom_op("pagellm::paged_attention", mutates_args=("out",))
def paged_attention_op(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                       num_seqs: int, block_size: int, block_m: int, scale: float, sliding_window: int,
                       logits_soft_cap: float, num_splits: int) -> None:
    """The launch as torch's dispatcher sees it: out [T, H_q, D] written in place; sliding_window 0 and
    logits_soft_cap 0.0 mean none; block_m: the query tile's rows (16 for a pure decode step, else 64, at least
    the GQA group); num_splits as paged_attention_triton resolves it."""
    _launch(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_seqs, block_size,
            block_m, scale, sliding_window, logits_soft_cap, num_splits)


@paged_attention_op.register_fake
def _(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, num_seqs, block_size, block_m,
      scale, sliding_window, logits_soft_cap, num_splits) -> None:
    return None  # writes `out` only: nothing to allocate


def _launch(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_seqs: int,
            block_size: int, block_m: int, scale: float, sliding_window: int, logits_soft_cap: float,
            num_splits: int) -> None:
    """The attention kernel (and the reduce of its splits) into `out`, its arguments checked first (the custom
    op's callers skip paged_attention_triton)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads or key_cache.shape != value_cache.shape:
        raise ValueError(f"query heads {num_heads} over {num_kv_heads} kv heads, K {tuple(key_cache.shape)} "
                         f"and V {tuple(value_cache.shape)}: not a GQA cache")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query, key_cache and value_cache need unit stride along the head dimension")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1 (the reduce kernel's range), got {num_splits}")
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    if block_m < max(16, block_g) or block_m % block_g:
        raise ValueError(f"block_m must be a multiple of the GQA group's {block_g} rows and at least 16, got "
                         f"{block_m}")
    if num_tokens == 0:
        return
    block_q = block_m // block_g
    block_d = max(16, triton.next_power_of_2(head_dim))
    partial = max_sum = out  # unused unless split
    if num_splits > 1:
        partial = torch.empty(num_tokens, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device)
        max_sum = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](  # K/V in another dtype than the queries are converted as the kernel loads them
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        partial, max_sum, scale, logits_soft_cap or 1.0, sliding_window, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0),
        G=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE=TILE_N,
        USE_CAP=logits_soft_cap > 0, USE_WINDOW=sliding_window > 0,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", NUM_SPLITS=num_splits)
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](out, partial, max_sum, out.stride(0), out.stride(1), num_heads,
                                                       NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count (0 off CUDA: nothing to fill, no split)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
