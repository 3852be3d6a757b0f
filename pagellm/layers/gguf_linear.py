"""A linear layer whose weight stays in its GGUF file's block formats (kernels/cpu/gguf_blocks.py).

    GGUFLinear      y = x W^T + b; W one or more row segments side by side, each in its own format (a joined
                    q/k/v whose parts the file stores as Q5_0, Q5_0 and Q8_0 is one layer, one output)
    (GGUFMoeExperts, a MoE layer's experts in their blocks: layers/gguf_moe.py)

The matmul quantizes x to int8 per 32 columns and runs integer dot products on the stored codes at every M (one
kernel: no crossovers by batch size); `rows` dequantizes looked-up rows exactly as the gguf package does, so a
token table held this way (QuantizedEmbedding) embeds the same vectors as the dense model of the file.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.cpu import gguf_blocks
from pagellm.kernels.cpu.gguf_blocks import GGUFWeight
from pagellm.layers.kernel_user import KernelUser


class GGUFLinear(KernelUser, nn.Module):
    scheme = "gguf"
    int8_activations = True  # its blocks multiply int8 activations whatever the dtype (csrc/quant_gguf.cpp)

    def __init__(self, segments: list[GGUFWeight], bias: torch.Tensor | None = None):
        super().__init__()
        segments = merged_segments(segments)
        self.in_features, self.out_features = segments[0].cols, sum(s.rows for s in segments)
        self.formats = tuple(s.ggml_type for s in segments)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, False)
        for i, segment in enumerate(segments):
            for name, tensor in zip(("qs", "gp", "sp"), segment.tensors()):
                self.register_buffer(f"{name}{i}", tensor)

    @classmethod
    def from_blocks(cls, weight: GGUFWeight, bias: torch.Tensor | None = None) -> GGUFLinear:
        return cls([weight], bias)

    def segments(self) -> list[GGUFWeight]:
        """The weight's segments over the current buffers (a buffer replaced or moved is seen at once)."""
        buffers = self._buffers
        return [GGUFWeight(t, buffers[f"qs{i}"].shape[0] * gguf_blocks.BLOCK_ROWS, self.in_features,
                           buffers[f"qs{i}"], buffers[f"gp{i}"], buffers[f"sp{i}"]) for i, t in enumerate(self.formats)]

    def use_kernel_level(self, level: str | None) -> None:
        if not gguf_blocks.available(level):  # known when planning: the blocks have no other path
            raise ValueError(f"weights kept in their GGUF blocks need the native kernels, which do not run at "
                             f"level {level!r}: load the model with the level it runs at")
        super().use_kernel_level(level)

    def bound(self) -> gguf_blocks.BoundMatmul:
        """The kernel bound to this layer's tensors (KernelUser.bound_to_tensors)."""
        return self.bound_to_tensors(
            "matmul", lambda: gguf_blocks.BoundMatmul(self.segments(), self.bias, self.kernel_level))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound()(x)  # [..., K] -> [..., N] in x's dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As an LM head: [N, K] -> [N, V] fp32, the kernel's fp32 sums unrounded (no bf16 pass to convert)."""
        return self.bound()(hidden, torch.float32)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized rows `ids` [T, K] (a token table's lookup: one segment)."""
        segments = self.segments()
        if len(segments) != 1:
            raise ValueError("row lookups read a single-segment GGUFLinear (a token table)")
        return gguf_blocks.rows(segments[0], ids, self.kernel_level, dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense [N, K] float32 weight (tests and references only)."""
        return torch.cat([gguf_blocks.rows(s, torch.arange(s.rows), self.kernel_level) for s in self.segments()])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"formats={'+'.join(t.name for t in self.formats)}")


def merged_segments(segments: list[GGUFWeight]) -> list[GGUFWeight]:
    """Neighbouring segments of one format concatenated: one kernel call for them."""
    out = [segments[0]]
    for s in segments[1:]:
        last = out[-1]
        if s.ggml_type == last.ggml_type and s.cols == last.cols:
            out[-1] = GGUFWeight(s.ggml_type, last.rows + s.rows, s.cols, *(_side_by_side(a, b) for a, b in zip(
                last.tensors(), s.tensors())))
        else:
            out.append(s)
    return out


def _side_by_side(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cat([a, b]); a view where b already starts where a ends in one storage (the block cache stores the parts
    of a join so: loader/repack_cache.py), which keeps mapped weights mapped rather than copied to the heap."""
    if a.shape[1:] == b.shape[1:] and _follows(a, b):
        return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride(), a.storage_offset())
    return torch.cat([a, b])


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(parts); a view where each part starts where the one before ends in one storage (the block
    cache stores a MoE layer's experts so), which keeps them mapped as _side_by_side does."""
    first = parts[0]
    if all(p.shape == first.shape for p in parts) and all(_follows(a, b) for a, b in zip(parts, parts[1:])):
        return first.as_strided((len(parts), *first.shape), (first.numel(), *first.stride()), first.storage_offset())
    return torch.stack(parts)


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b starts where a ends in one storage, both contiguous and of one dtype."""
    return bool(a.numel() and b.numel() and a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and b.storage_offset() == a.storage_offset() + a.numel())


def concat_gguf_linears(parts: list[GGUFLinear]) -> GGUFLinear | None:
    """One GGUFLinear computing the parts' outputs side by side, or None where they cannot be joined."""
    if any(p.in_features != parts[0].in_features or (p.bias is None) != (parts[0].bias is None) for p in parts):
        return None
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    return GGUFLinear([s for p in parts for s in p.segments()], bias)

