"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, sparse MoE MLPs.

Legend: T = tokens, E = hidden.

Layer i has a SparseMoeBlock (no shared expert) when
`(i not in mlp_only_layers) and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`,
else a dense GatedMLP of `intermediate_size`. Router top-k weights are
renormalised only if `norm_topk_prob` (False by default in transformers' config;
the released Qwen3-MoE configs set it True). Norms are the standard w·x/rms(x).
Attention, norms and RoPE are exactly Qwen3's (models/qwen3.py); a sliding
window applies to every layer iff `use_sliding_window` (HF sets
config.sliding_window to None otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.layers.moe import SparseMoeBlock, stack_expert_weights
from pagellm.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, options: AttentionOptions):
        super().__init__(config, layer_idx, options)
        if is_sparse_layer(config, layer_idx):  # replaces the dense MLP (built on the meta device: free)
            self.mlp = SparseMoeBlock(config, normalize=config.norm_topk_prob, shared_expert=False)


class Qwen3MoeModel(LlamaModel):
    def __init__(self, config, options: AttentionOptions):
        super().__init__(config, options)
        self.layers = nn.ModuleList(
            [Qwen3MoeDecoderLayer(config, i, options) for i in range(config.num_hidden_layers)])


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def build_backbone(config) -> nn.Module:
        bias = getattr(config, "attention_bias", False)
        return Qwen3MoeModel(config, AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True))

    def state_layers(self) -> list:
        return []  # attention only: no recurrent state

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Per-expert checkpoint keys -> the stacked expert parameters; the rest is a strict name match.
        super().load_weights(stack_expert_weights(self, weights, self.load_device))
