"""Paged attention: the native CPU kernel, and the torch reference it is checked against.

The interface: queries for the packed tokens of a step, the layer's whole KV
cache, and the block tables. K/V are addressed through the block table; the
reference gathers the blocks of one batch with an index, the native kernel
(`csrc/paged_attention.cpp`) reads them in place. `paged_attention` runs the
Triton kernel on CUDA (kernels/triton_attention.py); on CPU the native kernel
for float32/bfloat16 tensors with a head size that is a multiple of 16 (the
cache in the query's dtype, or bf16 under fp32 queries), when it was built
(see `native.load`), and the reference otherwise; the reference is the oracle
both kernels are tested against.

Masking follows HF transformers: token at position p sees keys at positions
k <= p, and with a sliding window W only those with p - k < W.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels import cuda_ops, native
from pagellm.kernels.binding import FLOATS, KV_CACHE_FLOATS, DtypeCode, Flag, Float, Function, Int, Tensor, kv_cache_pairs
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


_I64S = (torch.int64,)
_PAGED_ATTENTION = Function("pagellm_paged_attention", (
    Tensor("out", FLOATS), Tensor("query", FLOATS, rows=True), Tensor("key_cache", KV_CACHE_FLOATS, rows=True),
    Tensor("value_cache", KV_CACHE_FLOATS, rows=True), Tensor("block_tables", _I64S, rows=True),
    Tensor("query_start_loc", _I64S), Tensor("seq_lens", _I64S),
    *map(Int, ("num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size", "table_stride", "q_stride_tok",
               "q_stride_head", "k_stride_block", "k_stride_tok", "k_stride_head", "v_stride_block",
               "v_stride_tok", "v_stride_head")),
    Float("scale"), Int("window"), Float("soft_cap"), DtypeCode("query"), DtypeCode("key_cache"), Flag("num_threads")),
    returns=ctypes.c_int)
_LIBRARY = native.Library("paged_attention", [_PAGED_ATTENTION], "paged attention")
LIBRARIES = (_LIBRARY,)  # for kernels/selection.py


def _native_kernel(at: str | None):
    """The C++ entry point's unchecked caller at level `at`, or None."""
    return _LIBRARY.unchecked(_PAGED_ATTENTION.symbol, at)


def native_available(at: str | None) -> bool:
    """Whether the native paged-attention kernel runs at level `at` (built; None: native kernels off)."""
    return _native_kernel(at) is not None


def _native_supported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    # a copy of the cache would cost more than the reference: rows of unit stride are what the kernel takes
    return (query.shape[-1] % 16 == 0  # the AVX-512 loops step 16 lanes
            and _PAGED_ATTENTION.accepts(query=query, key_cache=key_cache, value_cache=value_cache)
            and key_cache.dtype == value_cache.dtype and kv_cache_pairs(query.dtype, key_cache.dtype))


def _int64_rows(t: torch.Tensor) -> torch.Tensor:
    """t as int64 with unit stride along its last dim (as the runner builds it: no copy)."""
    return t if t.dtype == torch.int64 and t.stride(-1) == 1 else t.to(torch.int64).contiguous()


def paged_attention_native(
    query: torch.Tensor,  # [T, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    *,
    at: str,
) -> torch.Tensor:  # [T, H_q, D]
    """The C++ kernel at level `at`; the caller checked `_native_supported` and `native_available(at)`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    tables, starts, lens = _int64_rows(meta.block_tables), _int64_rows(meta.query_start_loc), _int64_rows(meta.seq_lens)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
    if num_tokens == 0:
        return out
    status = _native_kernel(at)(
        out, query, key_cache, value_cache, tables, starts, lens,
        meta.num_seqs, num_heads, num_kv_heads, head_dim, meta.block_size, tables.stride(0),
        query.stride(0), query.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        scale, sliding_window or 0, logits_soft_cap or 0.0, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"pagellm_paged_attention failed with status {status}")
    return out


def paged_attention(
    query: torch.Tensor,  # [T, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    *,
    at: str | None,
) -> torch.Tensor:  # [T, H_q, D]
    """Causal attention of each request's new tokens over its whole paged context.

    On CUDA the Triton kernel (kernels/triton_attention.py); on CPU the native kernel at level `at` when it
    applies (see the module docstring); else the torch reference.
    """
    if query.device.type == "cuda":  # one launch per step, K/V read in place: not gathered, not looped over
        kernel = cuda_ops.triton_module("triton_attention").paged_attention_triton
        return kernel(query, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap)
    if (_native_supported(query, key_cache, value_cache)
            and _native_kernel(at) is not None):
        return paged_attention_native(query, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap,
                                      at=at)
    return paged_attention_reference(query, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap)
