"""Gated MLP shared by every family here: down(act(gate(x)) * up(x)).

After loading, `join_projections` replaces gate_proj and up_proj with one gate_up_proj (where the layer
types allow, see layers/quantized.concat_linears); act * up then runs as one fused kernel call
(kernels/layer_ops.act_mul) where it applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.layer_ops import act_mul
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.quantized import concat_linears

# HF `hidden_act` names -> the function HF's ACT2FN maps them to.
ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # act_mul's native ones


def gated_act(gate_up: torch.Tensor, activation: str, at: str | None) -> torch.Tensor:
    """[..., 2 I] (gate, then up) -> act(gate) * up [..., I]: one fused kernel call (CPU kernels at level `at`)
    where it applies."""
    fused = FUSED_ACTIVATIONS.get(activation)
    out = act_mul(gate_up, fused, at) if fused else None
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        out = ACTIVATION_FUNCTIONS[activation](gate) * up
    return out


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
        hidden = gated_act(self.gate_up_proj(x), self.activation, self.kernel_level)  # [T, 2 I] -> [T, I]
        return self.down_proj(hidden)  # [T, hidden]
