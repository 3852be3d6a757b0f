"""Llama family: Llama 2/3 and Mistral; Qwen2, Qwen3 and Gemma 3 build on its pieces.

Legend: T = tokens in the step (all requests packed), H = query heads,
K = kv heads, D = head_dim, E = hidden size, V = vocab size.

Module and parameter names mirror the HF checkpoint names, so loading is a
strict name match (`load_checkpoint_weights`). Models are built on the meta
device (see registry.build_model) and weights are assigned as they stream in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.attention import PagedAttention
from pagellm.layers.embedding import empty_embedding
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.norm import RMSNorm
from pagellm.layers.quantized import concat_linears, lm_head_logits
from pagellm.layers.rotary import RotaryEmbedding, rope_parameters
from pagellm.models.bound_layers import BoundModel, PlannedBackbone
from pagellm.kernels.attention_metadata import AttentionMetadata


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The attention window of one layer, None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral: one window (or none) for every layer
        return window
    return window if layer_types[layer_idx] == "sliding_attention" else None


# A block's output not yet added to the residual stream, and the norm it takes first (Gemma's post-norms).
Pending = tuple[torch.Tensor | None, RMSNorm | None]


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    norm_unit_offset: bool = False  # Gemma: norms scale by (1 + w)
    query_scale: float | None = None  # None: head_dim ** -0.5 (Gemma 3 uses query_pre_attn_scalar ** -0.5)


class LlamaAttention(KernelUser, nn.Module):
    def __init__(self, config, layer_idx: int, options: AttentionOptions):
        super().__init__()
        hidden, head_dim = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, head_dim)
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=options.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=options.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=options.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=options.o_bias)
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, unit_offset=options.norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, unit_offset=options.norm_unit_offset)
        scale = options.query_scale if options.query_scale is not None else head_dim**-0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, scale=scale,
                                   sliding_window=sliding_window_of(config, layer_idx))
        self.qkv_proj: nn.Module | None = None  # set by join_projections

    def join_projections(self) -> bool:
        """Replace q/k/v_proj with one qkv_proj (where their types allow; layers/quantized.concat_linears)."""
        joined = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        if joined is not None:
            del self.q_proj, self.k_proj, self.v_proj
            self.qkv_proj = joined
        return joined is not None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.qkv_proj is None:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        else:
            qkv = self.qkv_proj(h)  # [T, (H + 2K) * D]
            query = self._prepare_in_place(qkv, cos, sin, meta)
            if query is not None:  # k and v are already in the cache
                return self.o_proj(self.attn.attend(query, meta))  # [T, H * D] -> [T, E]
            q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                 self.num_kv_heads * self.head_dim], dim=-1)
        num_tokens = h.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, K, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, K, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, meta))  # [T, H * D] -> [T, E]

    def _prepare_in_place(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor | None:
        """q [T, H, D] normed and rotated, with k and v written to the cache, in one kernel call where the device
        has one for this layer (chosen once per dtype pair); None where it has not (nothing written)."""
        cache = self.attn.key_cache
        if cache is None or not self.qk_norms_fuse():
            return None
        dtypes = (qkv.dtype, cache.dtype)
        prepare = self.bound(dtypes, lambda: self.ops.qkv_prepare_for(self.head_dim, *dtypes))
        if prepare is None:
            return None
        return prepare(qkv, self.num_heads, self.num_kv_heads, *self.qk_norm_args(), cos, sin, cache,
                       self.attn.value_cache, meta.slot_mapping)

    def qk_norms_fuse(self) -> bool:
        """Whether q_norm and k_norm can run as one fused call (which applies one eps and flavour)."""
        return not self.qk_norm or self.q_norm.same_kind(self.k_norm)

    def qk_norm_args(self) -> tuple:
        """(q weight, k weight, eps, unit_offset) as qkv_prepare takes them (weights None: no q/k norm)."""
        if not self.qk_norm:
            return None, None, 0.0, False
        return self.q_norm.flavour_weight(), self.k_norm.flavour_weight(), self.q_norm.eps, self.q_norm.unit_offset


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, options: AttentionOptions):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, options)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                pending: Pending = (None, None)) -> tuple[torch.Tensor, Pending]:
        """h [T, E]: the residual stream; `pending`: the previous layer's MLP output, not yet added. Returns
        h and this layer's own pending output: each add is fused with the norm that follows it."""
        h, x = self.input_layernorm.residual(h, *pending)
        h, x = self.post_attention_layernorm.residual(h, self.self_attn(x, cos, sin, meta))
        return h, (self.mlp(x), None)  # [T, E] each


def llama_norms(layer: LlamaDecoderLayer) -> tuple:
    """(before attention, before the MLP, after attention, after the MLP): bound_layers' order."""
    return layer.input_layernorm, layer.post_attention_layernorm, None, None


class LlamaModel(PlannedBackbone, nn.Module):
    norms_of = staticmethod(llama_norms)  # for the plan (models/bound_layers.py)

    def __init__(self, config, options: AttentionOptions):
        super().__init__()
        self.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, options) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config),
                                         config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                plan: BoundModel | None = None) -> torch.Tensor:
        """plan: the runner's, chosen once (models/bound_layers.py); None runs the modules."""
        h = self.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [T, D/2] each
        if plan is not None:
            return plan(h, [(cos, sin)] * len(self.layers), meta)  # the same kernels as the modules, bound
        pending = (None, None)
        for layer in self.layers:
            h, pending = layer(h, cos, sin, meta, pending)
        return self.norm.residual(h, *pending)[1]  # [T, E]

    def materialize_buffers(self, device: torch.device) -> None:
        self.rotary_emb.materialize(device)


def _is_ignored_by_hf(name: str) -> bool:
    """Keys some checkpoints carry that HF recomputes instead of loading."""
    return "rotary_emb." in name


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    skip: Callable[[str], bool],
) -> None:
    """Assign each (name, tensor) to the parameter of that name, strictly.

    An unexpected name, a shape mismatch, or a parameter that never arrives is a
    ValueError naming it. Each tensor replaces the parameter object (cast to the
    parameter's dtype, moved to `device`), so a meta-device model is filled in
    without a second full copy of the weights.
    """
    expected = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        if name not in expected:
            raise ValueError(f"unexpected weight {name!r}: {type(model).__name__} has no such parameter")
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {shape}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s) of {type(model).__name__}: {shown}")


class LlamaForCausalLM(KernelUser, nn.Module):
    """Also serves MistralForCausalLM; Qwen2/Qwen3/Gemma 3 override `build_backbone`."""

    def __init__(self, hf_config, *, load_device: torch.device | str = "cpu"):
        super().__init__()
        self.config = hf_config
        self.load_device = torch.device(load_device)  # where load_weights puts the weights
        self.model = self.build_backbone(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self.final_logit_softcap = getattr(hf_config, "final_logit_softcapping", None)

    @staticmethod
    def build_backbone(config) -> nn.Module:
        bias = getattr(config, "attention_bias", False)
        return LlamaModel(config, AttentionOptions(qkv_bias=bias, o_bias=bias))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                plan: BoundModel | None = None) -> torch.Tensor:
        """[T] ids and positions -> [T, E]; plan: the runner's (models/bound_layers.py), None: the modules."""
        if plan is None:
            return self.model(input_ids, positions, attn_metadata)
        return self.model(input_ids, positions, attn_metadata, plan)

    def compute_logits(self, hidden: torch.Tensor, vocab_rows: slice | None = None) -> torch.Tensor:
        """[N, E] -> [N, V] fp32; `vocab_rows` (a dense head only): just those vocabulary rows' logits."""
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        if vocab_rows is not None:  # tensor parallel: this rank's share of the head (distributed/sharding.py)
            logits = F.linear(hidden, head.weight[vocab_rows])  # a view of the rows: no copy
        else:
            logits = lm_head_logits(head, hidden)  # [N, V]; dense, or quantized (layers/quantized.py)
        # One native pass: soft-cap with HF's roundings in the logits' dtype (fp32 already for a GGUF head, capped
        # in place: every head returns a fresh tensor), and the conversion to fp32.
        return self.ops.logits_to_f32(logits, self.final_logit_softcap,
                                      out=logits if logits.dtype == torch.float32 else None)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def skip(name: str) -> bool:
            # A tied checkpoint may still carry lm_head.weight; HF ties it to the embedding, so do we.
            return _is_ignored_by_hf(name) or (self.tie_word_embeddings and name == "lm_head.weight")

        load_checkpoint_weights(self, weights, self.load_device, skip)
        self.model.materialize_buffers(self.load_device)
