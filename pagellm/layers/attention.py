"""PagedAttention: writes this step's K/V into the paged cache, then attends through the block table.

The runner binds each layer's cache once (`bind_kv_cache`); the per-step
AttentionMetadata is passed in, never looked up from a global.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.reference.attention import write_kv
from pagellm.layers.kernel_user import KernelUser


class PagedAttention(KernelUser, nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.logits_soft_cap = scale, sliding_window, logits_soft_cap
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, H_kv, D]
        self.value_cache: torch.Tensor | None = None

    def bind_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        self.key_cache, self.value_cache = key_cache, value_cache

    def forward(
        self,
        query: torch.Tensor,  # [T, H_q, D]
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,  # [T, H_kv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H_q * D]
        if self.key_cache is None:
            raise RuntimeError("PagedAttention used before the runner bound its KV cache")
        write_kv(key, value, self.key_cache, self.value_cache, meta.slot_mapping)
        return self.attend(query, meta)

    def attend(self, query: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, H_q, D] -> [T, H_q * D]
        """Attention over the cache alone: this step's K/V must already be in it. The device's kernel where it
        takes this layer's head size and dtypes (chosen once per dtype pair), else the torch reference."""
        dtypes = (query.dtype, self.key_cache.dtype)
        attend = self.bound(dtypes, lambda: self.ops.attention_for(self.head_dim, *dtypes))
        out = attend(query, self.key_cache, self.value_cache, meta, self.scale, self.sliding_window,
                     self.logits_soft_cap)
        return out.flatten(1)  # [T, H_q * D]
