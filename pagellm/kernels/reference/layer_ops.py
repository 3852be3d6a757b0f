"""The layer ops in torch: the reference every device's kernels are tested against, and what a plan binds where a
device has no kernel (native kernels off or not built, a dtype the kernels do not take).

Each rounds where HF transformers rounds, so bf16 results match it: the norm runs in float32 and is cast back
where each flavour casts (Llama's before the weight, Gemma's (1 + w) after it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# HF `hidden_act` names -> the function HF's ACT2FN maps them to.
ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [..., dim] -> normalised [..., dim]: w * (x / rms(x)), or (1 + w) * (x / rms(x)) when unit_offset."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).type_as(x)
    return weight * normed.to(x.dtype)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, post_weight: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) for h = residual + post_norm(x) (post_weight None: x itself); both norms share eps and
    flavour."""
    h = residual + (x if post_weight is None else rms_norm(x, post_weight, eps, unit_offset))
    return h, rms_norm(h, weight, eps, unit_offset)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2]; same arithmetic as HF's rotate_half form."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]


def logits_to_f32(logits: torch.Tensor, cap: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Soft-capped (Gemma: in the logits' dtype, as HF does in the model's) and converted to fp32; `out` is the
    native kernel's reusable buffer, which torch does not need."""
    if cap is not None and cap > 0:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [..., 2 I] (gate, then up) -> act(gate) * up [..., I]; activation: an HF name."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATION_FUNCTIONS[activation](gate) * up
