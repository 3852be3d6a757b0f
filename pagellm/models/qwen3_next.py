"""Qwen3-Next (Qwen3NextForCausalLM): hybrid Gated DeltaNet / gated full attention, MoE with a shared expert.

Legend: T = tokens in the step, E = hidden, H = query heads, K = kv heads,
D = head_dim, R = rotary dims (partial_rotary_factor · D), V = vocab.

Differences from Qwen3, in reading order:
- `config.layer_types`: "linear_attention" layers use GatedDeltaNet (recurrent
  state in runner-bound slots, see layers/gated_delta_net.py); "full_attention"
  layers (every 4th by default) use paged attention.
- Full attention is gated: q_proj emits [q | gate] per head (2·D), the attention
  output is multiplied by sigmoid(gate) before o_proj.
- Every RMSNorm (decoder norms, q/k norms, final norm) is zero-centred, y = x/rms(x)·(1+w);
  the DeltaNet output norm is not (layers.gated_delta_net.GatedRMSNorm).
- Partial RoPE: only the first R = partial_rotary_factor · D dims of q/k rotate
  (rotate-half within those R), the rest pass through.
- MLP: SparseMoeBlock with a shared expert in layers where
  `(i not in mlp_only_layers) and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`,
  a dense GatedMLP elsewhere.
Qwen3.5 (models/qwen3_5.py) reuses all of this with split DeltaNet projections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagellm.layers.attention import PagedAttention
from pagellm.layers.embedding import empty_embedding
from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import SparseMoeBlock, stack_expert_weights
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, rope_parameters
from pagellm.models.bound_hybrid import BoundHybridLayer
from pagellm.models.bound_layers import BoundModel, PlannedBackbone
from pagellm.models.llama import LlamaForCausalLM, Pending, head_dim_of, sliding_window_of
from pagellm.models.mtp import MultiTokenPredictor, mtp_layers_of
from pagellm.kernels.attention_metadata import AttentionMetadata

MlpFactory = Callable[[object, int], nn.Module]  # (config, layer_idx) -> the layer's MLP


def partial_rotary(config) -> tuple[int, dict]:
    """(rotary dims R, RoPE parameters without the partial factor) for the attention layers."""
    params = dict(rope_parameters(config))
    factor = params.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(config) * factor), params


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate) -> torch.Tensor:
    """x [T, H, D] with cos/sin [T, R/2]: rotate the first R dims (rotate-half layout, `rotate`: the device's
    rotary op), keep the rest."""
    rotary = 2 * cos.shape[-1]
    if rotary == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


class GatedAttention(KernelUser, nn.Module):
    """Full attention with an output gate from q_proj, zero-centred q/k norms, partial RoPE."""

    def __init__(self, config, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        hidden, head_dim, bias = config.hidden_size, head_dim_of(config), config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, head_dim)
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim * 2, bias=bias)  # per head [q D | gate D]
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, unit_offset=True)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, scale=head_dim**-0.5,
                                   sliding_window=sliding_window)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = h.shape[0]
        q, gate = self.q_proj(h).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, H, D]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, K, D]
        v = self.v_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, K, D]
        rotate = self.ops.rotary
        q, k = apply_partial_rotary(q, cos, sin, rotate), apply_partial_rotary(k, cos, sin, rotate)
        out = self.attn(q, k, v, meta) * torch.sigmoid(gate.reshape(num_tokens, -1))  # [T, H * D]
        return self.o_proj(out)  # [T, E]


class HybridDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, fused_projections: bool, mlp_factory: MlpFactory,
                 layer_type: str | None = None):
        """layer_type: the config's for layer_idx unless given (an MTP layer, past the config's layers)."""
        super().__init__()
        self.layer_type = layer_type or config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, fused_projections)
        elif self.layer_type == "full_attention":
            window = sliding_window_of(config, layer_idx) if layer_type is None else None
            self.self_attn = GatedAttention(config, layer_idx, window)
        else:
            raise ValueError(f"layer {layer_idx}: unsupported layer type {self.layer_type!r}")
        self.mlp = mlp_factory(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                pending: Pending = (None, None)) -> tuple[torch.Tensor, Pending]:
        """h [T, E]: the residual stream; `pending`: the previous layer's MLP output, not yet added. Returns h and
        this layer's own pending output: each add is fused with the norm that follows it (as Llama's layers)."""
        h, x = self.input_layernorm.residual(h, *pending)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(x, meta)  # [T, E]
        else:
            mixed = self.self_attn(x, cos, sin, meta)  # [T, E]
        h, x = self.post_attention_layernorm.residual(h, mixed)
        return h, (self.mlp(x), None)  # [T, E] each


def hybrid_norms(layer: HybridDecoderLayer) -> tuple:
    """(before the token mixer, before the MLP, after the mixer, after the MLP): bound_layers' order."""
    return layer.input_layernorm, layer.post_attention_layernorm, None, None


class HybridModel(PlannedBackbone, nn.Module):
    norms_of = staticmethod(hybrid_norms)  # for the plan (models/bound_hybrid.py)
    bound_layer = BoundHybridLayer

    def __init__(self, config, fused_projections: bool, mlp_factory: MlpFactory):
        super().__init__()
        self.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([HybridDecoderLayer(config, i, fused_projections, mlp_factory)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        rotary_dim, params = partial_rotary(config)
        self.rotary_emb = RotaryEmbedding(rotary_dim, params, config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                plan: BoundModel | None = None) -> torch.Tensor:
        """plan: the runner's, chosen once (models/bound_hybrid.py); None runs the modules."""
        h = self.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [T, R/2] each
        if plan is not None:
            return plan(h, [(cos, sin)] * len(self.layers), meta)  # the same kernels as the modules, bound
        pending = (None, None)
        for layer in self.layers:
            h, pending = layer(h, cos, sin, meta, pending)
        return self.norm.residual(h, *pending)[1]  # [T, E]

    def materialize_buffers(self, device: torch.device) -> None:
        self.rotary_emb.materialize(device)


def qwen3_next_mlp(config, layer_idx: int) -> nn.Module:
    sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
              and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)
    if sparse:
        return SparseMoeBlock(config, normalize=config.norm_topk_prob, shared_expert=True)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


def checkpoint_renames(weights: Iterable[tuple[str, torch.Tensor]],
                       keep_mtp: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop what HF drops for these text models, and accept the multimodal wrapper's prefix.

    `mtp.*` (multi-token-prediction head: kept for a model built with it, models/mtp.py) and `model.visual.*`
    are ignored by HF's CausalLM classes; Qwen3.5 checkpoints saved from the vision-language wrapper
    keep the text model under `model.language_model.`.
    """
    for name, tensor in weights:
        if name.startswith("model.visual.") or name.startswith("mtp.") and not keep_mtp:
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, tensor


class HybridForCausalLM(LlamaForCausalLM):
    """Shared head and loading for the hybrid families; subclasses pick projections and MLPs."""

    fused_projections = True
    mlp_factory: MlpFactory = staticmethod(qwen3_next_mlp)

    def build_backbone(self, config) -> nn.Module:  # an instance method here: reads the class's choices
        return HybridModel(config, self.fused_projections, type(self).mlp_factory)

    def add_mtp(self) -> None:
        """Build the checkpoint's MTP head (speculative_config method mtp: models/mtp.py) as `self.mtp` (the
        loader does, as it builds the rest): its `mtp.*` weights are then loaded and required. A ValueError where
        the config names no MTP layer."""
        if not mtp_layers_of(self.config):
            raise ValueError("speculative_config method mtp needs a checkpoint with an MTP head (its config's "
                             "mtp_num_hidden_layers or num_nextn_predict_layers); this one has none")
        mlp_factory = type(self).mlp_factory

        def full_attention_layer(index: int) -> HybridDecoderLayer:
            return HybridDecoderLayer(self.config, index, self.fused_projections, mlp_factory,
                                      layer_type="full_attention")

        self.mtp = MultiTokenPredictor(self.config, full_attention_layer)

    def checkpoint_renames(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """loader/quantization.py renames with it too, to match incoming names to the layers it quantizes."""
        return checkpoint_renames(weights, keep_mtp=getattr(self, "mtp", None) is not None)

    def attention_layers(self) -> list[PagedAttention]:
        """The model's full-attention layers, then its MTP head's (its KV in the same blocks, sized with them)."""
        mtp = getattr(self, "mtp", None)
        layers = [*self.model.layers, *(mtp.layers if mtp is not None else ())]
        return [layer.self_attn.attn for layer in layers if layer.layer_type == "full_attention"]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.layer_type == "linear_attention"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(stack_expert_weights(self, self.checkpoint_renames(weights), self.load_device))


class Qwen3NextForCausalLM(HybridForCausalLM):
    pass
