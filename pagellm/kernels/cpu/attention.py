"""Paged attention's native CPU kernel (`csrc/paged_attention.cpp`): queries for the packed tokens of a step,
the layer's whole KV cache read in place through the block tables.

It takes float32/bfloat16 queries with a head size that is a multiple of 16, the cache in the query's dtype or a
16-bit one under fp32 queries (`takes`, known when a plan binds a layer: kernels/ops.py); the torch reference
(kernels/reference/attention.py) runs elsewhere and stays the oracle. Masking follows HF transformers.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.build import native
from pagellm.kernels.build.binding import (FLOATS, KV_CACHE_FLOATS, DtypeCode, Flag, Float, Function, Int, Tensor,
                                           kv_cache_pairs)


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


def takes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
    """Whether the kernel takes a layer of `head_dim` with `dtype` queries over a `kv_cache_dtype` cache (a
    cache's rows are of unit stride as the runner allocates them; a query view is copied)."""
    return (head_dim % 16 == 0  # the AVX-512 loops step 16 lanes
            and dtype in FLOATS and kv_cache_dtype in KV_CACHE_FLOATS and kv_cache_pairs(dtype, kv_cache_dtype))


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
    """The C++ kernel at level `at`; the caller checked `takes` and `native_available(at)` once, when planning."""
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
