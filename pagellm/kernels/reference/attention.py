"""Paged attention in torch ops: the reference every device's kernel is tested against (and what runs where a
device has no kernel for a layer: a head size the CPU kernel does not step, a K/V dtype it does not pair).

K/V are addressed through the block table; the reference gathers the blocks of one batch with an index.
Masking follows HF transformers: token at position p sees keys at positions k <= p, and with a sliding window W
only those with p - k < W.
"""

from __future__ import annotations

import torch

from pagellm.kernels.attention_metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Store this step's K/V at their slots, in place."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _attend(
    query: torch.Tensor,  # [B, Lq, H_kv, G, D]
    keys: torch.Tensor,  # [B, L, H_kv, D]
    values: torch.Tensor,  # [B, L, H_kv, D]
    query_pos: torch.Tensor,  # [B, Lq]
    kv_lens: torch.Tensor,  # [B]
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:  # [B, Lq, H_kv, G, D]
    acc = torch.promote_types(query.dtype, torch.float32)  # fp32 maths; fp64 for an fp64 oracle in the tests
    scores = torch.einsum("bqhgd,blhd->bhgql", query.to(acc), keys.to(acc)) * scale  # [B, H_kv, G, Lq, L]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    key_pos = torch.arange(keys.shape[1], device=keys.device)  # [L]
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        visible &= (query_pos[:, :, None] - key_pos[None, None, :]) < sliding_window  # [B, Lq, L]
    scores = scores.masked_fill(~visible[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Rows past a sequence's end hold whatever the block last stored (or uninitialised memory):
    # zero them, since 0 * NaN would still poison the weighted sum.
    in_range = (key_pos[None, :] < kv_lens[:, None])[:, :, None, None]  # [B, L, 1, 1]
    values = values.to(acc).masked_fill(~in_range, 0.0)
    out = torch.einsum("bhgql,blhd->bqhgd", probs, values)
    return out.to(query.dtype)


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, H_kv, D] x [B, nb] -> [B, nb * bs, H_kv, D]"""
    gathered = cache[block_table]  # [B, nb, bs, H_kv, D]
    return gathered.flatten(1, 2)


def paged_attention_reference(
    query: torch.Tensor,  # [T, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [T, H_q, D]
    """Causal attention of each request's new tokens over its whole paged context (torch ops)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    bs = meta.block_size
    out = torch.empty_like(query)
    if meta.is_pure_decode:
        # One token per request: attend the whole batch at once, padded to the longest context.
        num_blocks = -(-max(meta.seq_lens_host) // bs)
        table = meta.block_tables[:, :num_blocks]
        q = query.view(num_tokens, 1, num_kv_heads, group, head_dim)  # [B, 1, H_kv, G, D]
        query_pos = (meta.seq_lens - 1)[:, None]  # [B, 1]
        o = _attend(q, _gather_blocks(key_cache, table), _gather_blocks(value_cache, table),
                    query_pos, meta.seq_lens, scale, sliding_window, logits_soft_cap)
        return o.reshape(num_tokens, num_heads, head_dim)
    starts, lens = meta.query_start_loc_host, meta.seq_lens_host
    for b in range(meta.num_seqs):
        lo, hi, kv_len = starts[b], starts[b + 1], lens[b]
        if hi == lo:
            continue
        table = meta.block_tables[b : b + 1, : -(-kv_len // bs)]
        q = query[lo:hi].view(1, hi - lo, num_kv_heads, group, head_dim)  # [1, Lq, H_kv, G, D]
        query_pos = torch.arange(kv_len - (hi - lo), kv_len, device=query.device)[None]  # [1, Lq]
        o = _attend(q, _gather_blocks(key_cache, table), _gather_blocks(value_cache, table),
                    query_pos, meta.seq_lens[b : b + 1], scale, sliding_window, logits_soft_cap)
        out[lo:hi] = o.reshape(hi - lo, num_heads, head_dim)
    return out
