"""A token embedding built without initialising its weight, which a checkpoint is about to replace."""

from __future__ import annotations

import torch
from torch import nn


def empty_embedding(num_embeddings: int, embedding_dim: int, device: torch.device | str | None = None) -> nn.Embedding:
    """nn.Embedding with an uninitialised weight (on the meta device under build_model's device context).

    Why not nn.Embedding(n, d): its reset_parameters draws normal_ values, and on the meta device torch runs
    that through a decomposition that imports torch._dynamo and triton, which the process then holds in resident
    memory for good (docs/benchmarks/2026-11-24-where-the-memory-goes.md), for a weight never used.
    """
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim,
                                                                          device=device))
