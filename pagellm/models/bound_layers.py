"""The plan of a Llama-family backbone (dense or MoE MLPs): chosen once per device, its decoder layers bound to
the device's kernels.

`plan_model` decides once per model and runner (the runner calls it when it binds the KV cache, with tensor
parallel's all-reduce) which CPU kernel level every module calls (layers/kernel_user.py; the loader gave the
quantized layers the same, their layouts chosen for it) and whether the layers run bound, and says why not where
they cannot; the runner hands the bound plan to the backbone's forward every step. Bound, a step's layer is a few
direct kernel calls (five for a GGUF layer of Gemma 3): everything that does not change between steps (weight
pointers, norm flavours and their kernel weights, eps, head counts, the cache objects) is resolved at planning
time. Why: at decode a Gemma 3 270M layer spent more time in nn.Module dispatch and in the per-call checks of each
kernel wrapper than in its kernels, and a GPU's eager step is bound by the same host work.

The kernels are one set per device, chosen by its backend (runner/backend.py: `native_step_kernels` at the CPU's
level, or on CUDA `triton_step_kernels`, with cuBLAS matmuls). Bound applies when every linear layer is dense, in
GGUF blocks, or int4 with int8 activations (one kernel at every M, so no dispatch by batch size), the set takes the
dtype, head size and norms, and no module has a forward hook the plan does not know; otherwise, or with
KernelConfig.bound_layers off, the modules run (they are the reference: tests/models/test_bound_layers.py checks
the two bit for bit on the CPU, tests/gpu/test_cuda_plan.py the Triton set under Triton's interpreter). A change to
the layers after planning (a linear replaced, a hook added) takes effect at the next plan_model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import kv_cache_pairs
from pagellm.kernels.cpu import attention, layer_ops
from pagellm.kernels.cpu.gguf_blocks import BoundMatmul, BoundMLP
from pagellm.kernels.ops import FUSED_ACTIVATIONS, LayerOps, native_ops
from pagellm.layers.dense import DenseLinear
from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.layers.gguf_planes import GGUFPlanesLinear
from pagellm.layers.kernel_user import bind_kernel_level
from pagellm.layers.moe import SparseMoeBlock
from pagellm.layers.quantized import Int4Linear

_DTYPE_CODES = native.DTYPE_CODES


@dataclass(frozen=True)
class StepKernels:
    """The kernels a bound layer calls, one set per device, chosen once by its backend."""
    name: str  # as the plan's description says it
    add_rms_norm: Callable  # (h, x, post weight | None, weight, eps, unit_offset) -> (h + post(x), its norm)
    qkv_prepare: Callable  # (qkv, H, K, q_w, k_w, eps, unit_offset, cos, sin, k cache, v cache, slots) -> q
    attention: Callable  # (q, k cache, v cache, meta, scale, window, soft cap) -> [T, H, D]
    act_mul: Callable  # (gate_up, activation) -> act(gate) * up
    fuses_gguf: bool  # act_mul and add_rms_norm are the native ones, whose arithmetic gguf_blocks' fused calls repeat
    dtypes: tuple  # of the activations
    pairs: Callable[[torch.dtype, torch.dtype], bool]  # (activations, KV cache) dtypes taken together
    head_dim_ok: Callable[[int], bool]


def triton_step_kernels() -> StepKernels:
    """The bound layers' kernels on CUDA: the Triton ones (kernels/gpu/, imported here as kernels/ops.triton_ops
    says why), cuBLAS matmuls. The CUDA backend's (runner/backend.py)."""
    from pagellm.kernels.gpu import attention as gpu_attention
    from pagellm.kernels.gpu import layer_ops as ops

    return StepKernels("the Triton kernels", ops.add_rms_norm, ops.qkv_prepare, gpu_attention.paged_attention_triton,
                       ops.act_mul, False, ops.FLOATS, ops.pairs, ops.head_dim_ok)


def native_step_kernels(level: str | None) -> tuple[StepKernels | None, str]:
    """The bound layers' kernels on a CPU: the native ones at `level`, or (None, why not). The CPU backend's."""
    if not (layer_ops.native_available(level) and attention.native_available(level)):
        return None, "native kernels unavailable (no compiler, or switched off)"
    bind = functools.partial  # the level given once: the step calls them with their inputs alone
    return StepKernels(f"the kernels at {level}", bind(layer_ops.add_rms_norm_unchecked, at=level),
                       bind(layer_ops.qkv_prepare_unchecked, at=level),
                       bind(attention.paged_attention_native, at=level), bind(layer_ops.act_mul_unchecked, at=level),
                       True, tuple(_DTYPE_CODES), kv_cache_pairs,
                       lambda head_dim: head_dim % 16 == 0 and head_dim <= layer_ops.MAX_HEAD_DIM), ""


def bound_linear(module: nn.Module):
    """x -> module(x) without module dispatch, or None if the module's path depends on the batch size."""
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is DenseLinear:
        return module.bound_matmul()
    if type(module) is Int4Linear and module.int8_activations and module.dense_from_rows is None:
        return module.bound_matmul(True)
    if type(module) is GGUFLinear:
        return module.bound()
    if type(module) is GGUFPlanesLinear:
        return module.bound_matmul()
    return None


def blocks_hooked(blocks) -> bool:
    """Whether a forward hook sits on one of a layer's blocks or anything inside them: a bound step calls no
    module's forward (a module step's submodules aside), so such a hook would silently not run."""
    return any(m._forward_hooks or m._forward_pre_hooks for block in blocks for m in block.modules())


class BoundLayer:
    """One decoder layer's step: (h, x) -> (h, x), x the normed input of this layer, then of the next (the next
    layer's input norm, or the final norm: `next_norm`, set by BoundModel)."""

    def __init__(self, layer: nn.Module, norms: tuple, kernels: StepKernels, all_reduce=None,
                 narrow: tuple[torch.dtype, torch.dtype] | None = None, narrow_attention: bool = True):
        attn, mlp = layer.self_attn, layer.mlp
        self.kernels = kernels
        self.modules = (attn, mlp)
        self.norm_in, self.norm_mid, self.post_mid, self.post_mlp = norms
        # the norms' weights as the kernels take them (fp32 copies for the unit-offset flavour), made once
        self.weights = tuple(None if n is None else n.flavour_weight() for n in norms)
        self.all_reduce = all_reduce  # tensor parallel: sums each block's partial output over ranks, in place
        self.qkv, self.o = bound_linear(getattr(attn, "qkv_proj", None)), bound_linear(attn.o_proj)
        # A MoE block's step is its own (routing, then its experts' grouped matmuls at the plan's level): no hooks,
        # its partial sum all-reduced here as a dense MLP's. A dense MLP: its two matmuls and the activation.
        self.moe = mlp.forward if isinstance(mlp, SparseMoeBlock) else None
        dense = self.moe is None
        self.gate_up, self.down = ((bound_linear(getattr(mlp, "gate_up_proj", None)), bound_linear(mlp.down_proj))
                                   if dense else (None, None))
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.qk_args = attn.qk_norm_args()
        self.paged = attn.attn
        self.activation = FUSED_ACTIVATIONS[mlp.activation] if dense else None
        # narrow (PlanSettings.narrow, the activations' dtype): attention in the first where narrow_attention (the
        # K/V cache pairs with it), the o projection taking its output and writing the second; only where the
        # projection writes any output dtype (a GGUF's blocks)
        self.narrow_attention = None
        if (narrow is not None and narrow_attention and narrow[0] in kernels.dtypes
                and isinstance(self.o, BoundMatmul)):
            self.narrow_attention = narrow[0]
            self.o = functools.partial(self.o, out_dtype=narrow[1])
        # a GGUF MLP (gate/up of one format) in one call: the same bits, no intermediate stored (csrc/quant_gguf.cpp)
        code = layer_ops.ACTIVATIONS.get(self.activation) if dense else None
        self.fused_mlp = None
        if (code is not None and kernels.fuses_gguf
                and all(isinstance(linear, BoundMatmul) for linear in (self.gate_up, self.down))
                and BoundMLP.fuses(self.gate_up, self.down)):
            self.fused_mlp = BoundMLP(self.gate_up, self.down, code)
        # a GGUF o projection and the add + norm after it in one call, the same bits (no all-reduce between them)
        o_matmul = self.o.func if isinstance(self.o, functools.partial) else self.o
        self.o_add_norm = (o_matmul.add_norm if all_reduce is None and kernels.fuses_gguf
                           and isinstance(o_matmul, BoundMatmul) and o_matmul.fuses_add_norm() else None)
        # the MLP and the next norm's add + norm in one call, the same bits (no all-reduce between them)
        self.mlp_add_norm = (self.fused_mlp.add_norm if all_reduce is None and self.fused_mlp is not None
                             else None)
        self.next_norm = None  # (the norm after this layer, its flavour weight): BoundModel's to set
        # each fused residual call applies one eps and flavour to two norms
        self.ok = (None not in (self.qkv, self.o)
                   and (not dense or None not in (self.gate_up, self.down))
                   and kernels.head_dim_ok(attn.head_dim)  # known here, not mid-step
                   and all(self.norm_in.same_kind(n) for n in norms if n is not None) and attn.qk_norms_fuse())

    def hooked(self) -> bool:
        return blocks_hooked(self.modules)

    def module_steps(self) -> str:
        """What of the layer runs as its module's own step ("" if nothing), for the plan's reasons."""
        return "MoE block is" if self.moe is not None else ""

    def residual(self, h, x, post, norm, weight):
        """(h + post(x), norm of it) in one call (post: a flavour weight or None; weight: the norm's flavour
        weight)."""
        return self.kernels.add_rms_norm(h, x, post, weight, norm.eps, norm.unit_offset)

    def __call__(self, h, x, cos, sin, meta):
        tokens = h.shape[0]
        heads, kv_heads, head_dim = self.shape
        paged = self.paged
        _, w_mid, w_post_mid, w_post_mlp = self.weights
        kernels = self.kernels
        q = kernels.qkv_prepare(self.qkv(x), heads, kv_heads, *self.qk_args, cos, sin, paged.key_cache,
                                paged.value_cache, meta.slot_mapping)  # [T, H, D]; k, v in the cache
        if q is None:
            raise RuntimeError(f"qkv_prepare cannot take head_dim {head_dim}")
        if self.narrow_attention is not None:
            q = q.to(self.narrow_attention)  # attention's queries, scores and output narrow (K/V are already)
        out = kernels.attention(q, paged.key_cache, paged.value_cache, meta, paged.scale, paged.sliding_window,
                                paged.logits_soft_cap)
        out = out.view(tokens, heads * head_dim)
        if self.o_add_norm is not None:  # [T, H*D] -> h [T, E] and its norm
            h, x = self.o_add_norm(out, h, w_post_mid, w_mid, self.norm_mid.eps, self.norm_mid.unit_offset)
        else:
            attended = self.o(out)  # [T, E]
            if self.all_reduce is not None:
                attended = self.all_reduce(attended)
            h, x = self.residual(h, attended, w_post_mid, self.norm_mid, w_mid)
        norm, weight = self.next_norm
        if self.mlp_add_norm is not None:  # [T, E] -> h [T, E] and the next norm of it
            return self.mlp_add_norm(x, h, w_post_mlp, weight, norm.eps, norm.unit_offset)
        if self.fused_mlp is not None:
            mlp_out = self.fused_mlp(x)  # [T, E]
        elif self.moe is not None:
            mlp_out = self.moe(x)  # [T, E]: routed experts (and the shared one)
        else:
            mlp_out = self.down(kernels.act_mul(self.gate_up(x), self.activation))  # [T, 2I] -> [T, I] -> [T, E]
        if self.all_reduce is not None:
            mlp_out = self.all_reduce(mlp_out)
        return self.residual(h, mlp_out, w_post_mlp, norm, weight)


class BoundModel:
    """Every layer of a Llama-family backbone bound: h [T, E] embedded -> the final norm's output [T, E]."""

    def __init__(self, layers: list[BoundLayer], final_norm: nn.Module, dtype: torch.dtype, kernels: StepKernels):
        self.layers, self.final_norm, self.dtype, self.kernels = layers, final_norm, dtype, kernels
        self.final_weight = final_norm.flavour_weight()
        self.first_attention = next((layer.paged for layer in layers if layer.paged is not None), None)
        for layer, following in zip(layers, layers[1:]):  # each layer's MLP ends with the next one's input norm
            layer.next_norm = (following.norm_in, following.weights[0])
        layers[-1].next_norm = (final_norm, self.final_weight)

    def __call__(self, h: torch.Tensor, ropes: list, meta) -> torch.Tensor:
        """ropes: (cos, sin) [T, D/2] per layer, in the model dtype."""
        # the runner's invariants (a backbone without attention layers has no cache to pair)
        caches = self.first_attention.key_cache if self.first_attention is not None else h
        if h.dtype != self.dtype or caches is None or not self.kernels.pairs(self.dtype, caches.dtype):
            raise RuntimeError(f"the bound layers were planned for {self.dtype} activations and a KV cache paired "
                               f"with them; got {h.dtype} and {None if caches is None else caches.dtype}")
        x = self.layers[0].norm_in(h)
        for layer, (cos, sin) in zip(self.layers, ropes):
            h, x = layer(h, x, cos, sin, meta)
        return x


@dataclass(frozen=True)
class PlanSettings:
    """What a runner plans its model under: the CPU kernels' `level` (None: torch's reference ops; on a GPU the
    CPU kernels do not apply), the compute and K/V cache dtypes, KernelConfig.bound_layers, and tensor
    parallel's `all_reduce`, the sum over ranks after each attention and MLP block (the modules' forward hooks
    do the same on the module path, so those hooks are expected then)."""
    level: str | None
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    bound_layers: bool = True
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    narrow: torch.dtype | None = None  # attention's dtype over a cache of it, narrower than `dtype` (narrow_dtype)
    # The device's kernel set, as its backend chose it (Backend.step_kernels); None: the CPU's at `level`.
    kernels: tuple[StepKernels | None, str] | None = None
    # The device's layer ops the modules call (Backend.layer_ops); None: the CPU's at `level` for `dtype`.
    ops: LayerOps | None = None


def plan_backbone(backbone: nn.Module, norms_of, settings: PlanSettings, kernels: StepKernels | None = None,
                  layer_class=None) -> tuple[BoundModel | None, str]:
    """(the bound plan, "") if every layer of `backbone` can run bound under `settings`, else (None, why not).
    `kernels`: settings.kernels' unless given (tests run the Triton set on a CPU under its interpreter);
    `layer_class`: what binds a layer, the backbone's own unless given (an MTP head's: its model's)."""
    if not settings.bound_layers:
        return None, "bound layers switched off (KernelConfig.bound_layers)"
    why, dtype, all_reduce = "", settings.dtype, settings.all_reduce
    if kernels is None:
        kernels, why = settings.kernels or native_step_kernels(settings.level)
    layer_class = layer_class or getattr(type(backbone), "bound_layer", None) or BoundLayer
    why = (why or ("" if dtype in kernels.dtypes else f"{kernels.name} take {kernels.dtypes}, not {dtype}")
           or ("" if len(backbone.layers) else "no layers"))
    layers = []
    for index, layer in enumerate(backbone.layers):
        if why:
            break
        try:
            narrow = (settings.narrow, dtype) if settings.narrow is not None else None
            # checked once here, not in every step: attention narrows only over a cache of a pairing dtype
            narrow_attention = narrow is not None and kernels.pairs(settings.narrow, settings.kv_cache_dtype)
            bound = layer_class(layer, norms_of(layer), kernels, all_reduce, narrow, narrow_attention)
        except (AttributeError, KeyError) as e:  # not joined, an activation without a native kernel, ...
            why = f"layer {index} cannot be bound ({type(e).__name__}: {e})"
            break
        why = (("" if bound.ok else f"layer {index} has a linear, head size or norm the kernels do not take")
               or ("" if all_reduce is not None or not bound.hooked() else f"layer {index} has forward hooks"))
        layers.append(bound)
    if not why and not layers[-1].norm_in.same_kind(backbone.norm):  # the final add + norm is fused too
        why = "the final norm differs in kind from the layers' norms"
    return (None, why) if why else (BoundModel(layers, backbone.norm, dtype, kernels), "")


class PlannedBackbone:
    """Marker of a backbone whose layers a plan can bind: its forward takes the runner's plan (`plan`, a
    BoundModel) or runs the modules. `norms_of(layer)`: the layer's norms in BoundLayer's order; `bound_layer`:
    the class that binds one of its layers (None: BoundLayer)."""

    norms_of = None
    bound_layer = None


@dataclass(frozen=True)
class LayerPlan:
    """How a model's decoder layers run, chosen once by its runner: `bound` (the layers bound to the kernels) or
    None (the modules, the reference), and the choice in words (LLM.stats()["layers"], logged)."""
    bound: BoundModel | None
    description: str


def plan_model(model: nn.Module, settings: PlanSettings, kernels: StepKernels | None = None) -> LayerPlan:
    """The plan of `model` under `settings`: every module's layer ops and CPU kernels at settings.level, and its
    backbone's layers bound where they can be, else the modules and why."""
    bind_kernel_level(model, settings.level, settings.ops or native_ops(settings.level, settings.dtype))
    backbones = planned_backbones(model)
    if not backbones:
        return LayerPlan(None, "modules")
    backbone = backbones[0]
    bound, why = plan_backbone(backbone, type(backbone).norms_of, settings, kernels)
    dtype, kv_cache_dtype = settings.dtype, settings.kv_cache_dtype
    if bound is not None and not bound.kernels.pairs(dtype, kv_cache_dtype):
        bound, why = None, f"a {kv_cache_dtype} KV cache under {dtype} activations, which the kernels do not pair"
    described = f"bound to {bound.kernels.name} ({len(bound.layers)} layers)" if bound else f"modules: {why}"
    return LayerPlan(bound, described)


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations run in: its embedding's output (a quantized embedding says its own)."""
    embed = model.model.embed_tokens
    return getattr(embed, "dtype", None) or embed.weight.dtype


def planned_backbones(model: nn.Module) -> list[PlannedBackbone]:
    return [m for m in model.modules() if isinstance(m, PlannedBackbone)]
