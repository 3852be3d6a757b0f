"""Layers whose GGUF weights a GPU keeps in planes (kernels/reference/gguf_planes.py): the file's codes and
factors, at the file's size, multiplied by the device's kernels (kernels/gpu/gguf_matmul.py on CUDA).

    GGUFPlanesLinear    y = x W^T + b; W one or more segments side by side, each in its own format
    (GGUFPlanesExperts, a MoE layer's experts in planes: layers/gguf_moe.py)
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.reference import gguf_planes
from pagellm.kernels.reference.gguf_planes import PLANES, GGUFPlanes
from pagellm.layers.kernel_user import KernelUser


class GGUFPlanesLinear(KernelUser, nn.Module):
    scheme = "gguf_planes"

    def __init__(self, segments: list[GGUFPlanes], bias: torch.Tensor | None = None):
        super().__init__()
        segments = merged_planes(segments)
        self.in_features, self.out_features = segments[0].cols, sum(s.rows for s in segments)
        self.formats = tuple(s.ggml_type for s in segments)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, False)
        for i, segment in enumerate(segments):
            for name, tensor in zip(PLANES, segment.tensors()):
                self.register_buffer(f"{name}{i}", tensor)

    def segments(self) -> list[GGUFPlanes]:
        """The weight's segments over the current buffers (a buffer replaced or moved is seen at once)."""
        buffers = self._buffers
        return [GGUFPlanes(t, buffers[f"qs{i}"].shape[0], self.in_features, *(buffers[f"{p}{i}"] for p in PLANES))
                for i, t in enumerate(self.formats)]

    def bound_matmul(self):
        """(x, out dtype | None) -> y through the ops' kernel, bound to this layer's tensors
        (KernelUser.bound_to_tensors)."""
        return self.bound_to_tensors("matmul", lambda: self.ops.gguf_planes_matmul(self.segments(), self.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound_matmul()(x)  # [..., K] -> [..., N] in x's dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As an LM head: [N, K] -> [N, V] fp32, the kernel's fp32 sums unrounded."""
        return self.bound_matmul()(hidden, torch.float32)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized rows `ids` [T, K] (a token table's lookup: one segment)."""
        segments = self.segments()
        if len(segments) != 1:
            raise ValueError("row lookups read a single-segment GGUFPlanesLinear (a token table)")
        return self.ops.gguf_planes_rows(segments[0], ids, dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense [N, K] float32 weight (tests and references only)."""
        return torch.cat([gguf_planes.dequantize(s) for s in self.segments()])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"formats={'+'.join(t.name for t in self.formats)} (planes)")


def merged_planes(segments: list[GGUFPlanes]) -> list[GGUFPlanes]:
    """Neighbouring segments of one format and width joined: one kernel launch for them."""
    out = [segments[0]]
    for s in segments[1:]:
        if s.ggml_type == out[-1].ggml_type and s.cols == out[-1].cols:
            out[-1] = gguf_planes.joined([out[-1], s])
        else:
            out.append(s)
    return out


def concat_planes_linears(parts: list[GGUFPlanesLinear]) -> GGUFPlanesLinear | None:
    """One GGUFPlanesLinear computing the parts' outputs side by side, or None where they cannot be joined."""
    if any(p.in_features != parts[0].in_features or (p.bias is None) != (parts[0].bias is None) for p in parts):
        return None
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    joined = GGUFPlanesLinear([s for p in parts for s in p.segments()], bias)
    joined.use_ops(parts[0].ops)
    return joined
