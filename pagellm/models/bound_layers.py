"""The plan of a Llama-family backbone: chosen once after loading, its decoder layers bound to the native kernels.

`plan_backbone` decides once per model (the loader calls it; tensor parallel calls it again with its all-reduce)
whether the layers run bound, and says why not where they cannot; the backbone's forward then runs the plan
it was given, with no per-step choice. Bound, a step's layer is 9 direct kernel calls: everything that does not
change between steps (weight pointers, norm flavours, eps, head counts, the cache objects) is resolved at
planning time. Why: at decode a Gemma 3 270M layer spent more time in nn.Module dispatch and in the per-call
checks of each kernel wrapper than in its kernels.

Bound applies when every linear layer is dense, in GGUF blocks, or int4 with int8 activations (one kernel at
every M, so no dispatch by batch size), the norms, q/k preparation, attention and act * up have their native
kernels, and no module has a forward hook the plan does not know; otherwise, or with KernelConfig.bound_layers
off, the modules run (they are the reference: tests/models/test_bound_layers.py checks the two bit for bit). A
change to the layers after planning (a linear replaced, a hook added) takes effect at the next plan_backbone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import attention, layer_ops, native
from pagellm.kernels.binding import kv_cache_pairs
from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.layers.kernel_binding import KernelBinding
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
    def residual(h, x, post, norm):
        """(h + post(x), norm of it) in one call (post: a flavour weight or None; x None: h unchanged)."""
        if x is None:
            return h, norm(h)
        return layer_ops.add_rms_norm_unchecked(h, x, post, norm.flavour_weight(), norm.eps, norm.unit_offset)

    def __call__(self, h, cos, sin, meta, pending):
        tokens = h.shape[0]
        heads, kv_heads, head_dim = self.shape
        paged = self.paged
        h, x = self.residual(h, *pending, self.norm_in)
        q = layer_ops.qkv_prepare_unchecked(self.qkv(x), heads, kv_heads, *self.qk_args, cos, sin, paged.key_cache,
                                            paged.value_cache, meta.slot_mapping)  # [T, H, D]; k, v in the cache
        if q is None:
            raise RuntimeError(f"qkv_prepare cannot take head_dim {head_dim}")
        out = attention.paged_attention_native(q, paged.key_cache, paged.value_cache, meta, paged.scale,
                                               paged.sliding_window, paged.logits_soft_cap)
        post = None if self.post_mid is None else self.post_mid.flavour_weight()
        attended = self.o(out.view(tokens, heads * head_dim))  # [T, E]
        if self.all_reduce is not None:
            attended = self.all_reduce(attended)
        h, x = self.residual(h, attended, post, self.norm_mid)
        hidden = layer_ops.act_mul_unchecked(self.gate_up(x), self.activation)  # [T, 2I] -> [T, I]
        mlp_out = self.down(hidden)  # [T, E]
        if self.all_reduce is not None:
            mlp_out = self.all_reduce(mlp_out)
        return h, (mlp_out, None if self.post_mlp is None else self.post_mlp.flavour_weight())


class BoundModel:
    """Every layer of a Llama-family backbone bound: h [T, E] embedded -> the final norm's output [T, E]."""

    def __init__(self, layers: list[BoundLayer], final_norm: nn.Module, dtype: torch.dtype):
        self.layers, self.final_norm, self.dtype = layers, final_norm, dtype

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
        return BoundLayer.residual(h, *pending, self.final_norm)[1]


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


class PlannedBackbone(KernelBinding):
    """Mixin of a backbone whose forward runs its plan: `bound` where the layers could be bound, else the
    modules. `norms_of(layer)`: the layer's norms in BoundLayer's order."""

    norms_of = None
    plan_description = "modules: not planned yet"

    def plan_layers(self, enabled: bool, dtype: torch.dtype, all_reduce=None) -> str:
        """Choose, once, how the layers run; returns the choice in words."""
        bound, why = plan_backbone(self, type(self).norms_of, enabled, dtype, all_reduce)
        kv = self.__dict__.get("_kv_cache_dtype")
        if bound is not None and kv is not None and not kv_cache_pairs(dtype, kv):
            bound, why = None, f"a {kv} KV cache under {dtype} activations, which the kernels do not pair"
        self.__dict__["_bound"] = bound
        self.__dict__["_plan_settings"] = (enabled, dtype, all_reduce)
        self.plan_description = f"bound to the kernels ({len(bound.layers)} layers)" if bound else f"modules: {why}"
        return self.plan_description

    def fit_kv_cache(self, kv_cache_dtype: torch.dtype) -> str:
        """Plan again for the KV cache the runner bound (the modules, if the kernels cannot take its dtype)."""
        self.__dict__["_kv_cache_dtype"] = kv_cache_dtype
        return self.replan()

    def replan(self, all_reduce=None) -> str:
        """plan_layers again with the last plan's settings (and its all-reduce, unless one is given): after tensor
        parallel installed its all-reduce, or after a layer changed."""
        enabled, dtype, kept = self.__dict__.get("_plan_settings", (False, None, None))
        return self.plan_layers(enabled, dtype, all_reduce or kept)

    @property
    def bound(self) -> BoundModel | None:
        return self.__dict__.get("_bound")


def planned_backbones(model: nn.Module) -> list[PlannedBackbone]:
    return [m for m in model.modules() if isinstance(m, PlannedBackbone)]


def fit_kv_cache(model: nn.Module, kv_cache_dtype: torch.dtype) -> None:
    """Tell every planned backbone of `model` the dtype of the KV cache just bound to it."""
    for backbone in planned_backbones(model):
        backbone.fit_kv_cache(kv_cache_dtype)


def layer_plan(model: nn.Module) -> str:
    """How a loaded model's decoder layers run, in words (the plan of its backbone, if it has one)."""
    backbones = planned_backbones(model)
    return backbones[0].plan_description if backbones else "modules"
