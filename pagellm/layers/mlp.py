"""Gated MLP shared by every family here: down(act(gate(x)) * up(x)).

After loading, `join_projections` replaces gate_proj and up_proj with one gate_up_proj (where the layer
types allow, see layers/quantized.concat_linears); act * up then runs as one fused kernel call
(the device's act * up, kernels/ops.py) where it has one for the activation.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.reference.layer_ops import ACTIVATION_FUNCTIONS
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.quantized import concat_linears


class GatedMLP(KernelUser, nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATION_FUNCTIONS:
            raise ValueError(f"unsupported hidden activation {activation!r}; supported: {sorted(ACTIVATION_FUNCTIONS)}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation, self.act_fn = activation, ACTIVATION_FUNCTIONS[activation]
        self.gate_up_proj: nn.Module | None = None  # set by join_projections

    def join_projections(self) -> bool:
        joined = concat_linears([self.gate_proj, self.up_proj])
        if joined is not None:
            del self.gate_proj, self.up_proj
            self.gate_up_proj = joined
        return joined is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_proj is None:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        act_mul = self.bound("act_mul", lambda: self.ops.gated_act(self.activation))
        hidden = act_mul(self.gate_up_proj(x))  # [T, 2 I] -> [T, I]
        return self.down_proj(hidden)  # [T, hidden]
