"""Llama-family decoder layers bound once to their native kernels: a step's layer runs as 9 direct calls.

Why: at decode a Gemma 3 270M layer spent ~206 us with its weights in cache, of which ~95 us in kernels; the
rest was nn.Module dispatch and the per-call checks of each kernel wrapper (7-16 us each, 9 of them per layer).
Here everything that does not change between steps (weight pointers, norm flavours, eps, head counts, cache
pointers) is resolved once, and a step only checks what the step brings (dtype, contiguity).

It applies when every linear layer is dense, in GGUF blocks, or int4 with int8 activations (one kernel at every M, so no
dispatch by batch size), the norms, q/k preparation, attention and act * up have their native kernels, and no
module has forward hooks (tensor parallel's all-reduce); otherwise, or with KernelConfig.bound_layers off, the
modules run. The same kernels with the same arguments: results are bit-identical to the module path
(tests/models/test_bound_layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import attention, layer_ops, native
from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.layers.mlp import _FUSED_NAMES
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


def _path_settings(module: nn.Module) -> tuple:
    """What a linear's path depends on that may be changed after binding (plain attributes: a cheap read)."""
    return module.__dict__.get("dense_from_rows"), module.__dict__.get("int8_activations")


class BoundLayer:
    """One decoder layer's step: (h, pending) -> (h, pending), pending = (MLP output, its post-norm weight)."""

    def __init__(self, layer: nn.Module, norms: tuple):
        attn, mlp = layer.self_attn, layer.mlp
        self.modules = (attn, mlp)
        self.norm_in, self.norm_mid, self.post_mid, self.post_mlp = norms
        # (owner's module dict, name, module, its path settings): checked each step, as module dispatch would
        self.linears = [(block._modules, name, block._modules[name], _path_settings(block._modules[name]))
                        for block, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"),
                                            (mlp, "down_proj"))]
        self.qkv, self.o, self.gate_up, self.down = (_linear(entry[2]) for entry in self.linears)
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.qk_args = attn.qk_norm_args()
        self.paged = attn.attn
        self.activation = _FUSED_NAMES[mlp.activation]
        # each fused residual call applies one eps and flavour to two norms
        self.ok = (None not in (self.qkv, self.o, self.gate_up, self.down) and attn.head_dim % 16 == 0
                   and attn.head_dim <= layer_ops.MAX_HEAD_DIM  # known here, not mid-step
                   and all(self.norm_in.same_kind(n) for n in norms if n is not None) and attn.qk_norms_fuse())

    def current(self) -> bool:
        """No linear replaced or switched to another path since binding."""
        return all(modules.get(name) is module and _path_settings(module) == settings
                   for modules, name, module, settings in self.linears)

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
        h, x = self.residual(h, self.o(out.view(tokens, heads * head_dim)), post, self.norm_mid)
        hidden = layer_ops.act_mul_unchecked(self.gate_up(x), self.activation)  # [T, 2I] -> [T, I]
        return h, (self.down(hidden), None if self.post_mlp is None else self.post_mlp.flavour_weight())


class BoundModel:
    """Every layer of a Llama-family model bound (`usable`: whether every layer could be)."""

    usable = False

    def __init__(self, model: nn.Module, norms_of):
        self.layer_list = model.layers
        self.final_norm = model.norm
        self.layers: list[BoundLayer] = []
        if layer_ops._lib() is None or attention._native_kernel() is None:
            return
        try:
            self.layers = [BoundLayer(layer, norms_of(layer)) for layer in model.layers]
        except (AttributeError, KeyError):  # not joined, an activation without a native kernel, ...
            self.layers = []
        self.usable = (bool(self.layers) and all(layer.ok for layer in self.layers)
                       and self.layers[-1].norm_in.same_kind(model.norm))  # the final add + norm is fused too

    @classmethod
    def of(cls, model: nn.Module, norms_of) -> BoundModel | None:
        """The model's binding (kept on it, redone when a linear changed), or None if it cannot be used."""
        if not model.bind_layers:  # KernelConfig.bound_layers, set at load
            return None
        bound = model.__dict__.get("_bound_layers")
        if (bound is None or bound.layer_list is not model.layers
                or not all(layer.current() for layer in bound.layers)):
            bound = model.__dict__["_bound_layers"] = cls(model, norms_of)
        return bound if bound.usable else None

    def applies(self, h: torch.Tensor, ropes: list) -> bool:
        """Whether this step's inputs are ones the bound kernels take (checked once for all layers)."""
        dtype = h.dtype
        caches = self.layers[0].paged.key_cache
        return (dtype in _DTYPE_CODES and h.is_cpu and h.is_contiguous() and h.shape[0] > 0
                and caches is not None and caches.dtype == dtype
                and all(c.dtype == dtype and c.is_contiguous() and s.is_contiguous() for c, s in dict(
                    (id(r), r) for r in ropes).values())
                and not (torch.is_grad_enabled() and h.requires_grad)
                and not any(layer.hooked() for layer in self.layers))  # e.g. tensor parallel's all-reduce

    def __call__(self, h: torch.Tensor, ropes: list, meta) -> torch.Tensor:
        """h [T, E] (embedded) -> the final norm's output [T, E]; ropes: (cos, sin) per layer."""
        pending = (None, None)
        for layer, (cos, sin) in zip(self.layers, ropes):
            h, pending = layer(h, cos, sin, meta, pending)
        return BoundLayer.residual(h, *pending, self.final_norm)[1]
