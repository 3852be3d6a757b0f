"""The plan of a Llama-family backbone: chosen once after loading, its decoder layers bound to the native kernels.

`plan_model` decides once per model and runner (the runner calls it when it binds the KV cache, with tensor
parallel's all-reduce) whether the layers run bound, and says why not where they cannot; the runner hands the
plan to the backbone's forward every step, and nothing of it is kept on the modules. Bound, a step's layer is 9 direct kernel calls: everything that does not
change between steps (weight pointers, norm flavours, eps, head counts, the cache objects) is resolved at
planning time. Why: at decode a Gemma 3 270M layer spent more time in nn.Module dispatch and in the per-call
checks of each kernel wrapper than in its kernels.

Bound applies when every linear layer is dense, in GGUF blocks, or int4 with int8 activations (one kernel at
every M, so no dispatch by batch size), the norms, q/k preparation, attention and act * up have their native
kernels, and no module has a forward hook the plan does not know; otherwise, or with KernelConfig.bound_layers
off, the modules run (they are the reference: tests/models/test_bound_layers.py checks the two bit for bit). A
change to the layers after planning (a linear replaced, a hook added) takes effect at the next plan_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import attention, layer_ops, native
from pagellm.kernels.binding import kv_cache_pairs
from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.layers.mlp import FUSED_ACTIVATIONS
from pagellm.layers.quantized import Int4Linear

_DTYPE_CODES = native.DTYPE_CODES


def _linear(module: nn.Module):
    """x -> module(x) without module dispatch, or None if the module's path depends on the batch size."""
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is Int4Linear and module.int8_activations and module.dense_from_rows is None:
        return module._bound_matmul(True)
    if type(module) is GGUFLinear:
        return module.bound()
    return None


class BoundLayer:
    """One decoder layer's step: (h, pending) -> (h, pending), pending = (MLP output, its post-norm weight)."""

    def __init__(self, layer: nn.Module, norms: tuple, all_reduce=None):
        attn, mlp = layer.self_attn, layer.mlp
        self.modules = (attn, mlp)
        self.norm_in, self.norm_mid, self.post_mid, self.post_mlp = norms
        # the norms' weights as the kernels take them (fp32 copies for the unit-offset flavour), made once
        self.weights = tuple(None if n is None else n.flavour_weight() for n in norms)
        self.all_reduce = all_reduce  # tensor parallel: sums each block's partial output over ranks, in place
        self.qkv, self.o, self.gate_up, self.down = (_linear(getattr(attn, "qkv_proj", None)), _linear(attn.o_proj),
                                                     _linear(getattr(mlp, "gate_up_proj", None)), _linear(mlp.down_proj))
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.qk_args = attn.qk_norm_args()
        self.paged = attn.attn
        self.activation = FUSED_ACTIVATIONS[mlp.activation]
        # each fused residual call applies one eps and flavour to two norms
        self.ok = (None not in (self.qkv, self.o, self.gate_up, self.down) and attn.head_dim % 16 == 0
                   and attn.head_dim <= layer_ops.MAX_HEAD_DIM  # known here, not mid-step
                   and all(self.norm_in.same_kind(n) for n in norms if n is not None) and attn.qk_norms_fuse())

    def hooked(self) -> bool:
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    @staticmethod
    def residual(h, x, post, norm, weight):
        """(h + post(x), norm of it) in one call (post: a flavour weight or None; x None: h unchanged; weight:
        the norm's flavour weight)."""
        if x is None:
            return h, norm(h)
        return layer_ops.add_rms_norm_unchecked(h, x, post, weight, norm.eps, norm.unit_offset)

    def __call__(self, h, cos, sin, meta, pending):
        tokens = h.shape[0]
        heads, kv_heads, head_dim = self.shape
        paged = self.paged
        w_in, w_mid, w_post_mid, w_post_mlp = self.weights
        h, x = self.residual(h, *pending, self.norm_in, w_in)
        q = layer_ops.qkv_prepare_unchecked(self.qkv(x), heads, kv_heads, *self.qk_args, cos, sin, paged.key_cache,
                                            paged.value_cache, meta.slot_mapping)  # [T, H, D]; k, v in the cache
        if q is None:
            raise RuntimeError(f"qkv_prepare cannot take head_dim {head_dim}")
        out = attention.paged_attention_native(q, paged.key_cache, paged.value_cache, meta, paged.scale,
                                               paged.sliding_window, paged.logits_soft_cap)
        attended = self.o(out.view(tokens, heads * head_dim))  # [T, E]
        if self.all_reduce is not None:
            attended = self.all_reduce(attended)
        h, x = self.residual(h, attended, w_post_mid, self.norm_mid, w_mid)
        hidden = layer_ops.act_mul_unchecked(self.gate_up(x), self.activation)  # [T, 2I] -> [T, I]
        mlp_out = self.down(hidden)  # [T, E]
        if self.all_reduce is not None:
            mlp_out = self.all_reduce(mlp_out)
        return h, (mlp_out, w_post_mlp)


class BoundModel:
    """Every layer of a Llama-family backbone bound: h [T, E] embedded -> the final norm's output [T, E]."""

    def __init__(self, layers: list[BoundLayer], final_norm: nn.Module, dtype: torch.dtype):
        self.layers, self.final_norm, self.dtype = layers, final_norm, dtype
        self.final_weight = final_norm.flavour_weight()

    def __call__(self, h: torch.Tensor, ropes: list, meta) -> torch.Tensor:
        """ropes: (cos, sin) [T, D/2] per layer, in the model dtype."""
        caches = self.layers[0].paged.key_cache
        # the runner's invariants
        if h.dtype != self.dtype or caches is None or not kv_cache_pairs(self.dtype, caches.dtype):
            raise RuntimeError(f"the bound layers were planned for {self.dtype} activations and a KV cache paired "
                               f"with them; got {h.dtype} and {None if caches is None else caches.dtype}")
        pending = (None, None)
        for layer, (cos, sin) in zip(self.layers, ropes):
            h, pending = layer(h, cos, sin, meta, pending)
        return BoundLayer.residual(h, *pending, self.final_norm, self.final_weight)[1]


def plan_backbone(backbone: nn.Module, norms_of, enabled: bool, dtype: torch.dtype,
                  all_reduce=None) -> tuple[BoundModel | None, str]:
    """(the bound plan, "") if every layer of `backbone` (compute dtype `dtype`) can run bound, else (None, why
    not). `all_reduce`: tensor parallel's sum over ranks after each attention and MLP block (the modules'
    forward hooks do the same on the module path, so those hooks are expected then)."""
    if not enabled:
        return None, "bound layers switched off (KernelConfig.bound_layers)"
    why = (("" if backbone.norm.weight.is_cpu else "not on the CPU")  # first: nothing CPU is built for a GPU
           or ("native kernels unavailable (no compiler, or switched off)"
               if not (layer_ops.native_available() and attention.native_available()) else "")
           or ("" if dtype in _DTYPE_CODES else f"the kernels take fp32 and bf16, not {dtype}")
           or ("" if len(backbone.layers) else "no layers"))
    layers = []
    for index, layer in enumerate(backbone.layers):
        if why:
            break
        try:
            bound = BoundLayer(layer, norms_of(layer), all_reduce)
        except (AttributeError, KeyError) as e:  # not joined, an activation without a native kernel, ...
            why = f"layer {index} cannot be bound ({type(e).__name__}: {e})"
            break
        why = (("" if bound.ok else f"layer {index} has a linear, head size or norm the kernels do not take")
               or ("" if all_reduce is not None or not bound.hooked() else f"layer {index} has forward hooks"))
        layers.append(bound)
    if not why and not layers[-1].norm_in.same_kind(backbone.norm):  # the final add + norm is fused too
        why = "the final norm differs in kind from the layers' norms"
    return (None, why) if why else (BoundModel(layers, backbone.norm, dtype), "")


class PlannedBackbone:
    """Marker of a backbone whose layers a plan can bind: its forward takes the runner's plan (`plan`, a
    BoundModel) or runs the modules. `norms_of(layer)`: the layer's norms in BoundLayer's order."""

    norms_of = None


@dataclass(frozen=True)
class LayerPlan:
    """How a model's decoder layers run, chosen once by its runner: `bound` (the layers bound to the kernels) or
    None (the modules, the reference), and the choice in words (LLM.stats()["layers"], logged)."""
    bound: BoundModel | None
    description: str


def plan_model(model: nn.Module, enabled: bool, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
               all_reduce=None) -> LayerPlan:
    """The plan of `model` under compute dtype `dtype` and a KV cache of `kv_cache_dtype`: its backbone's
    layers bound where they can be (`enabled`: KernelConfig.bound_layers), else the modules and why.
    `all_reduce`: tensor parallel's sum over ranks after each block."""
    backbones = planned_backbones(model)
    if not backbones:
        return LayerPlan(None, "modules")
    backbone = backbones[0]
    bound, why = plan_backbone(backbone, type(backbone).norms_of, enabled, dtype, all_reduce)
    if bound is not None and not kv_cache_pairs(dtype, kv_cache_dtype):
        bound, why = None, f"a {kv_cache_dtype} KV cache under {dtype} activations, which the kernels do not pair"
    return LayerPlan(bound, f"bound to the kernels ({len(bound.layers)} layers)" if bound else f"modules: {why}")


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations run in: its embedding's output (a quantized embedding says its own)."""
    embed = model.model.embed_tokens
    return getattr(embed, "dtype", None) or embed.weight.dtype


def planned_backbones(model: nn.Module) -> list[PlannedBackbone]:
    return [m for m in model.modules() if isinstance(m, PlannedBackbone)]
