"""Gated MLP shared by every family here: down(act(gate(x)) * up(x))."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# HF `hidden_act` names -> the function HF's ACT2FN maps them to.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {activation!r}; supported: {sorted(_ACTIVATIONS)}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = _ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
