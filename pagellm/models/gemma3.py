"""Gemma 3 text (Gemma3ForCausalLM, config Gemma3TextConfig / model_type gemma3_text).

Differences from Llama, in reading order:
- RMSNorm scales by (1 + w); q_norm/k_norm per head before RoPE; four norms per
  layer (before and after attention, before and after the MLP).
- Layers are "sliding_attention" (window `config.sliding_window`) or
  "full_attention" (`config.layer_types`); each type has its own RoPE
  parameters (`config.rope_parameters[layer_type]`, e.g. theta 10k local, 1M global).
- Query scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- Embeddings are multiplied by sqrt(hidden), rounded to the model dtype as HF does.
- gelu-tanh MLP; final logits soft-capped when `final_logit_softcapping` is set
  (done by LlamaForCausalLM.compute_logits).

Legend: T = tokens, H = query heads, K = kv heads, D = head_dim, E = hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.embedding import empty_embedding
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, rope_parameters
from pagellm.models.bound_layers import BoundModel, PlannedBackbone
from pagellm.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, Pending, head_dim_of
from pagellm.kernels.attention_metadata import AttentionMetadata


def gemma3_attention_options(config) -> AttentionOptions:
    # No attention soft-capping: HF's Gemma3Attention never passes attn_logit_softcapping
    # to its attention function (Gemma 2 did), and released Gemma 3 configs set it to null.
    bias = config.attention_bias
    return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, norm_unit_offset=True,
                            query_scale=config.query_pre_attn_scalar**-0.5)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = LlamaAttention(config, layer_idx, gemma3_attention_options(config))
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                pending: Pending = (None, None)) -> tuple[torch.Tensor, Pending]:
        """As LlamaDecoderLayer.forward; the MLP output is left pending with its post-norm."""
        h, x = self.input_layernorm.residual(h, *pending)
        h, x = self.pre_feedforward_layernorm.residual(h, self.self_attn(x, cos, sin, meta),
                                                       self.post_attention_layernorm)
        return h, (self.mlp(x), self.post_feedforward_layernorm)  # [T, E] each


def gemma3_norms(layer: Gemma3DecoderLayer) -> tuple:
    """(before attention, before the MLP, after attention, after the MLP): bound_layers' order."""
    return (layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
            layer.post_feedforward_layernorm)


class Gemma3Model(PlannedBackbone, nn.Module):
    norms_of = staticmethod(gemma3_norms)  # for the plan (models/bound_layers.py)

    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (embedding models) is not supported")
        self.hidden_size = config.hidden_size
        self.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(self.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        head_dim, max_positions = head_dim_of(config), config.max_position_embeddings
        self.rotary_emb = nn.ModuleDict({
            layer_type: RotaryEmbedding(head_dim, rope_parameters(config, layer_type), max_positions)
            for layer_type in sorted(set(config.layer_types))
        })

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                plan: BoundModel | None = None) -> torch.Tensor:
        """plan: the runner's, chosen once (models/bound_layers.py); None runs the modules."""
        h = self.embed_tokens(input_ids)  # [T, E] in the model dtype, also from a QuantizedEmbedding
        h = h * self.embed_scale.to(h.dtype)  # sqrt(E) rounded to the dtype, as HF does
        rope = {layer_type: emb(positions, h.dtype) for layer_type, emb in self.rotary_emb.items()}
        ropes = [rope[layer.layer_type] for layer in self.layers]  # (cos, sin) [T, D/2] each
        if plan is not None:
            return plan(h, ropes, meta)  # the same kernels as the modules, bound
        pending = (None, None)
        for layer, (cos, sin) in zip(self.layers, ropes):
            h, pending = layer(h, cos, sin, meta, pending)
        return self.norm.residual(h, *pending)[1]  # [T, E]

    def materialize_buffers(self, device: torch.device) -> None:
        self.embed_scale = torch.tensor(self.hidden_size**0.5, device=device)
        for emb in self.rotary_emb.values():
            emb.materialize(device)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Same head as Llama (tied by default in Gemma configs, soft-capped logits if configured)."""

    @staticmethod
    def build_backbone(config) -> nn.Module:
        return Gemma3Model(config)
