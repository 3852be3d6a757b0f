"""Llama-family decoder layers bound once to their native kernels: a step's layer runs as 9 direct calls.

Why: at decode a Gemma 3 270M layer spent ~206 us with its weights in cache, of which ~95 us in kernels; the
rest was nn.Module dispatch and the per-call checks of each kernel wrapper (7-16 us each, 9 of them per layer).
Here everything that does not change between steps (weight pointers, norm flavours, eps, head counts, cache
pointers) is resolved once, and a step only checks what the step brings (dtype, contiguity).

It applies when every linear layer is dense or int4 with int8 activations (one kernel at every M, so no
dispatch by batch size), the norms, q/k preparation, attention and act * up have their native kernels, and no
module has forward hooks (tensor parallel's all-reduce); otherwise, or with PAGELLM_BOUND_LAYERS=0, the modules
run. The same kernels with the same arguments: results are bit-identical to the module path
(tests/models/test_bound_layers.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import attention, layer_ops
from pagellm.layers.mlp import _FUSED_NAMES
from pagellm.layers.quantized import Int4Linear

_DTYPE_FLAG = {torch.float32: 0, torch.bfloat16: 1}


def _linear(module: nn.Module):
    """x -> module(x) without module dispatch, or None if the module's path depends on the batch size."""
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is Int4Linear and module.int8_activations and module.dense_from_rows is None:
        return module._bound_matmul(True)
    return None


class BoundLayer:
    """One decoder layer's step: (h, pending) -> (h, pending), pending = (MLP output, its post-norm weight)."""

    def __init__(self, layer: nn.Module, norms: tuple, lib):
        attn, mlp = layer.self_attn, layer.mlp
        self.modules = (attn, mlp)
        self.norm_in, self.norm_mid, self.post_mid, self.post_mlp = norms
        self.qkv, self.o = _linear(attn.qkv_proj), _linear(attn.o_proj)
        self.gate_up, self.down = _linear(mlp.gate_up_proj), _linear(mlp.down_proj)
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        qk = (attn.q_norm.flavour_weight(), attn.k_norm.flavour_weight()) if attn.qk_norm else (None, None)
        self.qk_weights = qk
        self.qk_eps, self.qk_unit_offset = (attn.q_norm.eps, attn.q_norm.unit_offset) if attn.qk_norm else (0.0, False)
        self.paged = attn.attn
        self.activation = layer_ops.ACTIVATIONS[_FUSED_NAMES[mlp.activation]]
        self.lib = lib
        shared = [n for n in norms if n is not None]  # each fused call applies one eps and flavour to two norms
        self.ok = (None not in (self.qkv, self.o, self.gate_up, self.down) and attn.head_dim % 16 == 0
                   and len({(n.eps, n.unit_offset) for n in shared}) == 1
                   and not (attn.qk_norm and attn.k_norm.eps != attn.q_norm.eps))

    def hooked(self) -> bool:
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def residual(self, h, x, post, norm, flag):
        """(h + post(x), norm of it) in one call (post: a flavour weight or None)."""
        if x is None:
            return h, norm(h)
        new_h, out = torch.empty_like(h), torch.empty_like(h)
        w = norm.flavour_weight()
        self.lib.pagellm_add_rms_norm(h.data_ptr(), x.data_ptr(), None if post is None else post.data_ptr(),
                                      w.data_ptr(), new_h.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1],
                                      norm.eps, flag, int(norm.unit_offset))
        return new_h, out

    def __call__(self, h, cos, sin, meta, pending, flag: int):
        tokens = h.shape[0]
        heads, kv_heads, head_dim = self.shape
        h, x = self.residual(h, *pending, self.norm_in, flag)
        qkv = self.qkv(x)  # [T, (H + 2K) D]
        q = torch.empty(tokens, heads, head_dim, dtype=h.dtype)
        cache = (self.paged.key_cache, self.paged.value_cache)
        q_w, k_w = self.qk_weights
        status = self.lib.pagellm_qkv_prepare(
            qkv.data_ptr(), tokens, heads, kv_heads, head_dim, None if q_w is None else q_w.data_ptr(),
            None if k_w is None else k_w.data_ptr(), self.qk_eps, int(self.qk_unit_offset), cos.data_ptr(),
            sin.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), meta.slot_mapping.data_ptr(),
            cache[0].numel() // (kv_heads * head_dim), q.data_ptr(), flag)
        if status:
            raise IndexError(f"qkv_prepare refused the step (status {status}): a slot outside the KV cache?")
        paged = self.paged
        out = attention.paged_attention_native(q, cache[0], cache[1], meta, paged.scale, paged.sliding_window,
                                               paged.logits_soft_cap)
        post = None if self.post_mid is None else self.post_mid.flavour_weight()
        h, x = self.residual(h, self.o(out.view(tokens, heads * head_dim)), post, self.norm_mid, flag)
        gate_up = self.gate_up(x)  # [T, 2 I]
        hidden = torch.empty(tokens, gate_up.shape[1] // 2, dtype=h.dtype)
        self.lib.pagellm_act_mul(gate_up.data_ptr(), tokens, hidden.shape[1], self.activation, hidden.data_ptr(), flag)
        return h, (self.down(hidden), None if self.post_mlp is None else self.post_mlp.flavour_weight())


def _signature(model: nn.Module) -> tuple:
    """What binding depends on that may change after loading: the linear modules and their path settings."""
    linears = [getattr(block, name, None) for layer in model.layers
               for block, names in ((layer.self_attn, ("qkv_proj", "o_proj")), (layer.mlp, ("gate_up_proj", "down_proj")))
               for name in names]
    return tuple((id(m), getattr(m, "dense_from_rows", None), getattr(m, "int8_activations", None)) for m in linears)


class BoundModel:
    """Every layer of a Llama-family model bound (`usable`: whether every layer could be)."""

    def __init__(self, model: nn.Module, norms_of):
        self.signature = _signature(model)
        self.layers: list[BoundLayer] = []
        self.final_norm = model.norm
        lib = layer_ops._lib()
        if lib is None or attention._native_kernel() is None:
            return
        try:
            self.layers = [BoundLayer(layer, norms_of(layer), lib) for layer in model.layers]
        except (AttributeError, KeyError):  # not joined, an activation without a native kernel, ...
            self.layers = []
        self.usable = bool(self.layers) and all(layer.ok for layer in self.layers)

    usable = False

    @classmethod
    def of(cls, model: nn.Module, norms_of) -> BoundModel | None:
        """The model's binding (kept on it, redone when its linear modules change), or None if unusable."""
        if os.environ.get("PAGELLM_BOUND_LAYERS", "1") == "0":
            return None
        bound = model.__dict__.get("_bound_layers")
        if bound is None or bound.signature != _signature(model):
            bound = model.__dict__["_bound_layers"] = cls(model, norms_of)
        return bound if bound.usable else None

    def applies(self, h: torch.Tensor, ropes: list) -> bool:
        dtype = h.dtype
        caches = self.layers[0].paged.key_cache
        return (dtype in _DTYPE_FLAG and h.is_cpu and h.is_contiguous() and h.shape[0] > 0
                and caches is not None and caches.dtype == dtype
                and all(c.dtype == dtype and c.is_contiguous() and s.is_contiguous() for c, s in dict(
                    (id(r), r) for r in ropes).values())
                and not (torch.is_grad_enabled() and h.requires_grad)
                and not any(layer.hooked() for layer in self.layers))

    def __call__(self, h: torch.Tensor, ropes: list, meta) -> torch.Tensor:
        """h [T, E] (embedded) -> the final norm's output [T, E]; ropes: (cos, sin) per layer."""
        flag = _DTYPE_FLAG[h.dtype]
        pending = (None, None)
        for layer, (cos, sin) in zip(self.layers, ropes):
            h, pending = layer(h, cos, sin, meta, pending, flag)
        return self.layers[-1].residual(h, *pending, self.final_norm, flag)[1]
