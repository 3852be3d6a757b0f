"""The plan of a hybrid backbone (Qwen3-Next, Qwen3.5, dense and MoE): its decoder layers bound as the Llama
family's are (models/bound_layers.py), with what has no fused kernel yet run as its module's own step.

A hybrid layer is a token mixer (Gated DeltaNet, or gated attention), then an MLP (dense or MoE). Bound, the
residual adds and the norms between the blocks are the fused add + norm kernel, a dense MLP its two matmuls and
the fused activation; the token mixer and a MoE block run their own steps (`module.forward`: the same kernels the
modules call, without their dispatch and hooks). The modules are the reference: bit-identical (the module path
fuses the same adds, tests/models/test_bound_layers.py). Planned alike on CPUs and on CUDA (there checked under
Triton's interpreter only: tests/gpu/test_cuda_plan.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.ops import FUSED_ACTIVATIONS
from pagellm.layers.moe import SparseMoeBlock
from pagellm.models.bound_layers import StepKernels, blocks_hooked, bound_linear


class BoundHybridLayer:
    """One hybrid decoder layer's step: (h, x) -> (h, x), x the normed input of this layer, then of the next
    (`next_norm`, set by BoundModel). BoundLayer's interface, for BoundModel and plan_backbone; `narrow` is taken
    and not applied (neither this step nor the modules narrow the gated attention)."""

    def __init__(self, layer: nn.Module, norms: tuple, kernels: StepKernels, all_reduce=None,
                 narrow: tuple[torch.dtype, torch.dtype] | None = None, narrow_attention: bool = True):
        self.kernels, self.all_reduce = kernels, all_reduce
        self.norm_in, self.norm_mid = norms[0], norms[1]
        self.weights = (self.norm_in.flavour_weight(), self.norm_mid.flavour_weight())
        self.linear_mixer = layer.layer_type == "linear_attention"
        mixer = layer.linear_attn if self.linear_mixer else layer.self_attn
        self.mixer = mixer.forward  # its own step: Gated DeltaNet's (state in place), or the gated attention's
        self.paged = None if self.linear_mixer else mixer.attn
        mlp = layer.mlp
        self.modules = (mixer, mlp)
        self.moe = mlp.forward if isinstance(mlp, SparseMoeBlock) else None
        dense = self.moe is None
        self.gate_up = bound_linear(mlp.gate_up_proj) if dense and hasattr(mlp, "gate_up_proj") else None
        self.down = bound_linear(mlp.down_proj) if dense else None
        self.activation = FUSED_ACTIVATIONS.get(mlp.activation) if dense else None
        self.next_norm = None  # (the norm after this layer, its flavour weight): BoundModel's to set
        self.ok = ((not dense or None not in (self.gate_up, self.down, self.activation))
                   and self.norm_in.same_kind(self.norm_mid))

    def hooked(self) -> bool:
        return blocks_hooked(self.modules)

    def module_steps(self) -> str:
        return "token mixer and MoE block are" if self.moe is not None else "token mixer is"

    def __call__(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta):
        kernels = self.kernels
        mixed = self.mixer(x, meta) if self.linear_mixer else self.mixer(x, cos, sin, meta)  # [T, E]
        if self.all_reduce is not None:
            mixed = self.all_reduce(mixed)
        h, x = kernels.add_rms_norm(h, mixed, None, self.weights[1], self.norm_mid.eps, self.norm_mid.unit_offset)
        if self.moe is not None:
            mlp_out = self.moe(x)  # [T, E]: routed experts and the shared one
        else:
            mlp_out = self.down(kernels.act_mul(self.gate_up(x), self.activation))  # [T, 2I] -> [T, I] -> [T, E]
        if self.all_reduce is not None:
            mlp_out = self.all_reduce(mlp_out)
        norm, weight = self.next_norm
        return kernels.add_rms_norm(h, mlp_out, None, weight, norm.eps, norm.unit_offset)
