"""One device's layer ops, chosen once: the table a plan binds into every module (layers/kernel_user.py).

    native_ops(level, dtype)   a CPU: the C++ kernels at `level` for every op they take `dtype` in (kernels/cpu/),
                               the torch reference for the rest (no kernel built, native kernels off, fp16)
    triton_ops()               CUDA: Triton norms, q/k/v preparation, act * up, paged attention, the Gated
                               DeltaNet's decode and prefill, MoE routing and GGUF planes (kernels/gpu/), rotary
                               in torch, cuBLAS matmuls
    REFERENCE                  torch ops (kernels/reference/): the oracle both are tested against

Which implementation runs is decided here and by a plan, from what is known before a step: the device, the
kernels' level, the activations' and the K/V cache's dtypes, a layer's head size and activation. A module calls
what it was bound to, with no device test and no "None means the reference" at the call: a kernel given inputs it
does not take raises (kernels/cpu/layer_ops.refuse).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagellm.kernels.build.binding import FLOATS
from pagellm.kernels.cpu import attention as cpu_attention
from pagellm.kernels.cpu import elementwise, gated_delta_decode, layer_ops, logits
from pagellm.kernels.reference import attention as reference_attention
from pagellm.kernels.reference import gguf_planes as reference_planes
from pagellm.kernels.reference import layer_ops as reference

# HF `hidden_act` names -> the activation the fused act * up kernels compute (CPU and Triton alike).
FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# A MoE block's expert dispatch on a CPU: per token up to this many tokens, grouped above (layers/moe.py says why).
PER_TOKEN_MAX_TOKENS = 1


def _never(*_) -> bool:
    return False


def cpu_moe_path(tokens: int, dtype: torch.dtype, hidden: int, intermediate: int) -> str:
    """A CPU's expert dispatch: per token for one token, else torch's grouped matmul where torch has it."""
    if tokens <= PER_TOKEN_MAX_TOKENS:
        return "per_token"
    return "grouped_mm" if hasattr(torch, "_grouped_mm") else "grouped_loop"


def cuda_moe_path(tokens: int, dtype: torch.dtype, hidden: int, intermediate: int) -> str:
    """CUDA's: in bf16 always the grouped call (no host sync and no Python loop whatever the batch; torch's CUTLASS
    kernel on Hopper), its rows 16-byte aligned as that kernel wants; the loop otherwise."""
    aligned = hidden % 8 == 0 and intermediate % 8 == 0
    return "grouped_mm" if dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm") else "grouped_loop"


class DeltaDecode(NamedTuple):
    """A device's Gated DeltaNet decode kernels (the contract: kernels/cpu/gated_delta_decode.py)."""

    check: Callable  # (conv state, recurrent state, x, conv weight, slots: list) -> None; raises if not taken
    conv_: Callable  # (conv state [S, C, K-1], slots [B], x [B, C], weight [C, K]) -> silu(conv) [B, C]
    rule_: Callable  # (state [S, Hv, dk, dv], slots, q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv]) -> [B, Hv, dv]
    skips_padding: bool = False  # a negative slot (a padded row of a captured step) is read and written nowhere
    # (conv state, recurrent state, src [B], dst [B]) -> None: rows src copied to rows dst in both, a negative either
    # side skipped; a captured verify step's rollback rows (layers/gated_delta_net.py); None: not captured
    copy_rows_: Callable | None = None


@dataclass(frozen=True)
class LayerOps:
    """Each layer op as one device runs it. The per-layer choices (`gated_act`, `attention_for`,
    `qkv_prepare_for`) are made when a module binds them, from its own static shape."""
    name: str
    rms_norm: Callable  # (x [..., dim], weight, eps, unit_offset) -> [..., dim]
    add_rms_norm: Callable  # (h, x, post weight | None, weight, eps, unit_offset) -> (h + post(x), its norm)
    rotary: Callable  # (x [T, H, D], cos, sin [T, D/2]) -> [T, H, D]
    act_mul: Callable | None  # (gate_up [..., 2I], a FUSED_ACTIVATIONS value) -> [..., I]; None: torch's
    attention: Callable  # (q [T, H, D], k cache, v cache, meta, scale, window, soft cap) -> [T, H, D]
    takes_attention: Callable[[int, torch.dtype, torch.dtype], bool]  # (head_dim, dtype, K/V dtype)
    qkv_prepare: Callable | None  # (qkv, H, K, q_w, k_w, eps, unit_offset, cos, sin, caches, slots) -> q
    takes_qkv: Callable[[int, torch.dtype, torch.dtype], bool]
    # A Gated DeltaNet decode step's kernels, in place on the state slots; None: the torch reference
    # (layers/gated_delta_net.py)
    gated_delta_decode: DeltaDecode | None
    moe_path: Callable[[int, torch.dtype, int, int], str]  # (tokens, dtype, E, I) -> an experts' dispatch
    logits_to_f32: Callable  # (logits [N, V], soft cap | None, out [N, V] fp32 | None) -> fp32 logits
    # GGUF weights in planes (kernels/reference/gguf_planes.py): (segments, bias) -> (x, out dtype | None) -> y,
    # and (planes, ids, dtype) -> rows; a GPU's Triton kernels, elsewhere the torch reference (a test's CPU)
    gguf_planes_matmul: Callable = reference_planes.ReferencePlanesMatmul
    gguf_planes_rows: Callable = reference_planes.rows
    # a MoE layer's experts in planes in grouped launches: (x, weights, ids, gate_up, down, act_mul) -> [T, E];
    # None: an expert at a time through gguf_planes_matmul
    gguf_planes_moe: Callable | None = None
    # the router's top-k: (logits [T, X], k, normalize) -> (weights, ids) [T, k]; None: torch's (layers/moe.route)
    moe_route: Callable | None = None
    # the Gated DeltaNet's output norm: (x, gate, weight, eps) -> (w * rms_norm(x)) * silu(gate); None: torch's
    gated_rms_norm: Callable | None = None
    # the Gated DeltaNet's prefill rule over a step's requests at once, states in place at their slots: (state,
    # q, k, v, g, beta, [PrefillSequence]) -> [T, Hv, dv] fp32 (kernels/gpu/gated_delta_prefill.py); None: one
    # request at a time in torch (layers/gated_delta_net.py)
    gated_delta_prefill: Callable | None = None

    def gated_act(self, activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """gate_up [..., 2I] -> act(gate) * up [..., I] for an HF activation name: the fused kernel where this
        device has one for it, else torch's."""
        fused = FUSED_ACTIVATIONS.get(activation)
        if self.act_mul is not None and fused is not None:
            return functools.partial(self.act_mul, activation=fused)
        return functools.partial(reference.act_mul, activation=activation)

    def attention_for(self, head_dim: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> Callable:
        """The attention a layer of `head_dim` runs with `dtype` queries over a `kv_cache_dtype` cache."""
        if self.takes_attention(head_dim, dtype, kv_cache_dtype):
            return self.attention
        return reference_attention.paged_attention_reference

    def qkv_prepare_for(self, head_dim: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> Callable | None:
        """The fused q/k/v preparation such a layer runs, or None (separate norms, rotary and K/V write)."""
        return self.qkv_prepare if self.takes_qkv(head_dim, dtype, kv_cache_dtype) else None


REFERENCE = LayerOps("torch reference ops", reference.rms_norm, reference.add_rms_norm, reference.rotary, None,
                     reference_attention.paged_attention_reference, _never, None, _never, None, cpu_moe_path,
                     reference.logits_to_f32)


@functools.cache
def native_ops(level: str | None, dtype: torch.dtype | None = None) -> LayerOps:
    """A CPU's ops at kernel level `level` (None: native kernels off) for `dtype` activations (None: any the
    kernels take): each op's kernel where the level has it and takes the dtype, else the reference."""
    takes = dtype is None or dtype in FLOATS
    if level is None or not takes:
        return REFERENCE
    bind = functools.partial  # the level given once: a call passes its inputs alone

    def kernel_or_reference(available: bool, kernel: Callable, fallback):
        return bind(kernel, at=level) if available else fallback

    fused = layer_ops.native_available(level)
    attends = cpu_attention.native_available(level)
    decode = gated_delta_decode.available(level)
    return LayerOps(
        f"the kernels at {level}",
        kernel_or_reference(elementwise.available("rms_norm", level), elementwise.rms_norm, reference.rms_norm),
        kernel_or_reference(fused, layer_ops.add_rms_norm, reference.add_rms_norm),
        kernel_or_reference(elementwise.available("rotary", level), elementwise.rotary, reference.rotary),
        kernel_or_reference(fused, layer_ops.act_mul, None),
        kernel_or_reference(attends, cpu_attention.paged_attention_native,
                            reference_attention.paged_attention_reference),
        cpu_attention.takes if attends else _never,
        kernel_or_reference(fused, layer_ops.qkv_prepare, None),
        layer_ops.takes_qkv if fused else _never,
        DeltaDecode(gated_delta_decode.check_decode, bind(gated_delta_decode.conv_decode_, at=level),
                    bind(gated_delta_decode.rule_decode_, at=level)) if decode else None,
        cpu_moe_path,
        kernel_or_reference(logits.available("logits_to_f32", level), logits.logits_to_f32, reference.logits_to_f32))


def triton_ops() -> LayerOps:
    """CUDA's ops. The Triton modules are imported here, on a CUDA backend's first plan: importing triton costs a
    CPU-only process start-up time for nothing, and `triton.jit` reads TRITON_INTERPRET when a kernel module is
    imported (the tests run them under the interpreter)."""
    from pagellm.kernels.gpu import attention as gpu_attention
    from pagellm.kernels.gpu import gated_delta as delta
    from pagellm.kernels.gpu import gated_delta_prefill as delta_prefill
    from pagellm.kernels.gpu import gguf_matmul as gpu_gguf
    from pagellm.kernels.gpu import layer_ops as gpu_layer_ops
    from pagellm.kernels.gpu import moe as gpu_moe

    ops = gpu_layer_ops
    return LayerOps("the Triton kernels", ops.rms_norm, ops.add_rms_norm, reference.rotary, ops.act_mul,
                    gpu_attention.paged_attention_triton, ops.takes, ops.qkv_prepare, ops.takes,
                    DeltaDecode(delta.check_decode, delta.conv_decode_, delta.rule_decode_, skips_padding=True,
                                copy_rows_=delta.copy_state_rows_),
                    cuda_moe_path,
                    reference.logits_to_f32, gpu_gguf.BoundPlanesMatmul, gpu_gguf.rows, gpu_moe.planes_experts,
                    gpu_moe.route, ops.gated_rms_norm, delta_prefill.rule_prefill_)
