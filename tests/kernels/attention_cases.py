"""Paged-attention test cases shared by the CPU kernel's tests and the Triton kernel's (tests/gpu)."""

from __future__ import annotations

import dataclasses

import torch

from pagellm.kernels.attention_metadata import AttentionMetadata


@dataclasses.dataclass
class Case:
    query: torch.Tensor  # [T, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
              seed=0, placement_seed=None, cache_dtype=None) -> Case:
    """Random K/V for every token of every context, in shuffled physical blocks; the rest NaN.

    The logical content depends on `seed` only, the physical placement on `placement_seed`. The cache is in
    `cache_dtype` (default: the query's `dtype`).
    """
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3  # spare blocks that no table uses, left NaN
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(
        seed + 1 if placement_seed is None else placement_seed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n])
        start += n
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    value_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    for seq_len, table in zip(seq_lens, tables):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return Case(query, key_cache, value_cache, meta, head_dim**-0.5)
