"""Weight-only int8 / int4 linear layers kept quantized in memory, and a quantized token table.

    Int8Linear          per-output-row symmetric int8:  w[n, k] = q[n, k] * scale[n]
    Int4Linear          per-(row, 32-column group) asymmetric int4: w = (q - 8) * scale[n, g] + zero[n, g], q in 0..15
    QuantizedEmbedding  a token table held once, as an Int8Linear or Int4Linear: the lookup dequantizes only
                        the looked-up rows, and as a tied LM head it runs the same quantized matmul

Legend: M = activation rows (tokens), N = out features (rows of W), K = in features, G = K / 32.
How codes are fitted and laid out: layers/quant_codes.py.

Paths, by M (measured crossovers: NATIVE_BELOW_ROWS, DENSE_FROM_ROWS):
- the native kernel (kernels/cpu/quant_gemv.py, where it builds: AVX-512 BF16), below NATIVE_BELOW_ROWS: int4 in
  its own layout, int8 in [N, K]; activations fp32 or bf16 as given, rounded to bf16 inside, the result in the
  activation dtype. It reads weights near memory bandwidth, which is what decode needs.
- torch's kernel (2.15 CPU), the reference, below DENSE_FROM_ROWS: for layers without the native kernel, and
  int8 between the two crossovers. aten._weight_int8pack_mm and aten._weight_int4pack_mm_for_cpu accept fp32
  or bf16 activations with scales of the same dtype, but only their bf16 path is vectorized. So activations
  pass through them in bf16 (cast back to the model dtype after) and the scales are stored in bf16.
  measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
- int4 x int8 activations (kernels/cpu/quant_gemv.py int4_matmul_q8): native int4 layers at every M where AVX-512
  the kernel builds (every level) and int8_activations is on (the default); the other paths then serve int8
  weights, torch's int4 layout and KernelConfig.int8_activations off.
- dense tiles above: `forward` dequantizes TILE_ROWS weight rows at a time into one scratch buffer and runs a
  dense matmul in the activation dtype per tile. Nothing dense stays resident. int4 in the native layout has
  no torch kernel, so its tiles take over at NATIVE_BELOW_ROWS.
Both int4 layouts hold the same bytes: N*K/2 of codes and a bf16 scale and zero per 32-column group.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.cpu import quant_gemv
from pagellm.kernels.cpu.gguf_blocks import GGUFWeight
from pagellm.kernels.build.native import default_level
from pagellm.kernels.reference.gguf_planes import GGUFPlanes
from pagellm.layers.embedding import empty_embedding
from pagellm.layers.gguf_linear import GGUFLinear, concat_gguf_linears
from pagellm.layers.gguf_planes import GGUFPlanesLinear, concat_planes_linears
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.quant_codes import (  # noqa: F401  -- GROUP_SIZE, GroupAffine, can_quantize: the loader's
    GROUP_SIZE, KERNEL_DTYPE, GroupAffine, Int4Layout, can_quantize, group_affine_from_float, int4_row_codes,
    pack_int4, quantize_int8, unpack_tile)

TILE_ROWS = 4096  # weight rows dequantized per dense tile: 4096 x 640 bf16 = 5 MB, within L3
_ALIGN = 64  # torch's int8 kernel loads activation rows with aligned AVX loads: a misaligned view segfaults

# M (activation rows) from which the dense-tile path beats torch's int kernel, by (scheme, vocab-sized head,
# bf16 activations). An fp32 head never leaves the kernel: its M is the number of sequences sampling in a step.
# measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
DENSE_FROM_ROWS = MappingProxyType({
    ("int8", False, True): 64, ("int8", True, True): 32, ("int4", False, True): 160, ("int4", True, True): 256,
    ("int8", False, False): 512, ("int8", True, False): 1 << 30, ("int4", False, False): 512,
    ("int4", True, False): 1 << 30,
})
# M below which the native kernels run (same keys). int4 in the native layout has no torch kernel: dense tiles
# take over from there. int8 keeps torch's layout: its kernel runs in between, if anywhere. int4 in fp32 never
# hands over: its dense tiles are slow in fp32.
# measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
NATIVE_BELOW_ROWS = MappingProxyType({
    ("int8", False, True): 64, ("int8", True, True): 32, ("int4", False, True): 80, ("int4", True, True): 320,
    ("int8", False, False): 256, ("int8", True, False): 128, ("int4", False, False): 1 << 30,
    ("int4", True, False): 1 << 30,
})
_HEAD_ROWS = 65536  # a layer with more output rows than this is a vocab head


def int8_activations_default() -> bool:
    """int4 layers take int8 activations where the kernel runs (every level with a compiler; the loader applies
    KernelConfig.int8_activations and the engine's level after): faster than bf16 activations, for an activation
    rounding error well below the int4 weights' own
    (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md)."""
    return quant_gemv.q8_available(default_level())


def _aligned_kernel_input(x: torch.Tensor) -> torch.Tensor:
    x = x.to(KERNEL_DTYPE).contiguous()
    return x if x.data_ptr() % _ALIGN == 0 else x.clone()


class QuantizedLinear(KernelUser, nn.Module):
    """y = x W^T + b with W held quantized. Subclasses supply the int kernels, rows, and dense tiles."""

    scheme = ""
    int8_activations = False  # int4 x int8 products: an Int4Linear option

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, native: bool,
                 dense_from_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, False)
        self.native = native  # kernels/cpu/quant_gemv.py below the crossover, else torch's kernel
        self.dense_from_rows = dense_from_rows  # None: the measured crossover for the activation dtype

    def use_kernel_level(self, level: str | None) -> None:
        if not self.runs_at(level):  # known when planning, not mid-step
            raise ValueError(f"an {self.scheme} layer built for kernel level {self.kernel_level!r} has no kernel at "
                             f"{level!r} that computes with its layout: load the model with the level it runs at")
        super().use_kernel_level(level)

    def runs_at(self, level: str | None) -> bool:
        """Whether the kernels of `level` compute with this layer as built (torch's layouts run anywhere)."""
        return not self.native or quant_gemv.available(level)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features  # M
        native_below, dense_from = self._crossovers(x.dtype == torch.bfloat16)
        if rows < native_below:  # the decode path: kept to one kernel call and one allocation
            return self.bound_matmul(self.int8_activations)(x)  # [..., N] in x's dtype, bias added
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if rows >= dense_from:
            y = self._dense_matmul(x2)
        else:
            y = self._torch_kernel(_aligned_kernel_input(x2)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _crossovers(self, bf16: bool) -> tuple[int, int]:
        """(M below which the native kernel runs, M from which dense tiles run); torch's kernel in between."""
        key = (self.scheme, self.out_features > _HEAD_ROWS, bf16)
        dense_from = self.dense_from_rows or DENSE_FROM_ROWS[key]
        return (min(NATIVE_BELOW_ROWS[key], dense_from) if self.native else 0), dense_from

    def bound_matmul(self, q8: bool = False) -> quant_gemv.BoundMatmul:
        names = self._weight_buffers
        weight, scales = self._buffers[names[0]], self._buffers[names[1]]  # plain dict reads: no __getattr__
        bound = self.bindings.get(q8)
        if bound is None or not bound.binds(weight, scales, self.bias):  # built once; again if a buffer is replaced
            bound = self.bindings[q8] = quant_gemv.BoundMatmul(self.scheme, weight, scales, self.bias, q8,
                                                               self.kernel_level)
        return bound

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize TILE_ROWS rows at a time into one scratch buffer; a dense matmul per tile."""
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        scratch = self._tile_scratch(min(TILE_ROWS, self.out_features), x.dtype)
        for start in range(0, self.out_features, TILE_ROWS):
            stop = min(start + TILE_ROWS, self.out_features)
            out[:, start:stop] = F.linear(x, self._weight_tile(start, stop, scratch))
        return out

    def dequantize(self) -> torch.Tensor:
        """The dense [N, K] float32 weight the kernels compute with (tests and references only)."""
        scratch = self._tile_scratch(min(TILE_ROWS, self.out_features), torch.float32)
        tiles = [self._weight_tile(s, min(s + TILE_ROWS, self.out_features), scratch).clone()
                 for s in range(0, self.out_features, TILE_ROWS)]
        return torch.cat(tiles)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, native={self.native}, dense_from_rows={self.dense_from_rows}")


class Int8Linear(QuantizedLinear):
    scheme = "int8"
    _weight_buffers = ("qweight", "scale")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dense_from_rows: int | None = None, native: bool | None = None):
        native = quant_gemv.available(default_level()) if native is None else native
        super().__init__(*qweight.shape, bias, native, dense_from_rows)
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))  # [N]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs) -> Int8Linear:
        if isinstance(weight, GroupAffine):
            weight = weight.dequantize()
        return cls(*quantize_int8(weight), bias, **kwargs)

    def _torch_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        ids = ids.reshape(-1)
        return (self.qweight[ids].float() * self.scale[ids].float()[:, None]).to(dtype)  # [T, K]

    def _tile_scratch(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, self.in_features, dtype=dtype, device=self.qweight.device)

    def _weight_tile(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
        tile = scratch[: stop - start]
        # fp32 scale: q * scale is then exact in fp32 (7 + 8 bits) and rounds once into a bf16 tile
        return torch.mul(self.qweight[start:stop], self.scale[start:stop, None].float(), out=tile)  # [rows, K]


class Int4Linear(QuantizedLinear):
    scheme = "int4"
    _weight_buffers = ("packed", "scales_and_zeros")

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, layout: Int4Layout,
                 bias: torch.Tensor | None = None, dense_from_rows: int | None = None,
                 int8_activations: bool | None = None):
        super().__init__(packed.shape[0], packed.shape[1] * 2, bias, layout.native, dense_from_rows)
        self.layout = layout
        # int4 x int8 products (kernels/cpu/quant_gemv.py int4_matmul_q8), as llama.cpp's Q4 x Q8 dot products, at
        # every M, the vocab head's too even where it is a little slower: a request's logits must not depend on
        # how many others sample in the step (the two kernels' results differ).
        # measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
        self.int8_activations = layout.native and (int8_activations_default() if int8_activations is None
                                                   else int8_activations)
        self.register_buffer("packed", packed)  # [N, K/2] uint8 in `layout`
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # bf16: [N/16, G, 2, 16] native, else [G, N, 2]

    @classmethod
    def from_float(cls, weight, bias: torch.Tensor | None = None, native: bool | None = None,
                   **kwargs) -> Int4Linear:
        """From a float [N, K] weight (requantized) or a GroupAffine (kept as it is); in the native kernel's
        layout when that kernel is available (or `native`), else in torch's."""
        affine = weight if isinstance(weight, GroupAffine) else group_affine_from_float(weight)
        native = quant_gemv.native_layout_available(default_level()) if native is None else native
        return cls(*pack_int4(affine, native), bias, **kwargs)

    def _torch_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)

    def runs_at(self, level: str | None) -> bool:
        if not self.layout.native:
            return True
        return quant_gemv.q8_available(level) if self.int8_activations else quant_gemv.native_layout_available(level)

    def _crossovers(self, bf16: bool) -> tuple[int, int]:
        if not self.native:
            return super()._crossovers(bf16)
        # the native layout has no torch kernel: native kernel, then dense tiles, which the int8-activation
        # kernel beats at every M measured.
        # measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
        if not self.int8_activations and not quant_gemv.available(self.kernel_level):
            below = 0  # no bf16-activation kernel at this level (it needs AVX-512 BF16): dense tiles at every M
        elif self.dense_from_rows:
            below = self.dense_from_rows
        else:
            below = 1 << 30 if self.int8_activations else NATIVE_BELOW_ROWS[
                (self.scheme, self.out_features > _HEAD_ROWS, bf16)]
        return below, below

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.native:
            out = torch.empty(ids.numel(), self.in_features, dtype=dtype)
            return quant_gemv.int4_rows(self.packed, self.scales_and_zeros, ids, out, self.kernel_level)
        codes = int4_row_codes(self.packed, self.layout, ids)  # [T, K]
        sz = self.scales_and_zeros[:, ids.reshape(-1)].float().transpose(0, 1)  # [T, G, 2]
        w = (codes.view(codes.shape[0], -1, GROUP_SIZE).float() - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(codes.shape).to(dtype)  # the kernel's own arithmetic: exact in fp32 (q - 8 has 4 bits, scale 8)

    def _tile_scratch(self, rows: int, dtype: torch.dtype) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        device = self.packed.device
        if self.native:
            return torch.empty(self.in_features, rows, dtype=dtype, device=device)
        return (torch.empty(self.in_features, rows, dtype=torch.uint8, device=device),
                torch.empty(self.in_features, rows, dtype=dtype, device=device))

    def _weight_tile(self, start: int, stop: int, scratch) -> torch.Tensor:
        if self.native:
            tile = scratch[:, : stop - start]  # [K, rows]
            return quant_gemv.int4_tile_t(self.packed, self.scales_and_zeros, start, stop, tile,
                                          self.kernel_level).t()
        codes, tile = (buf[:, : stop - start] for buf in scratch)  # [K, rows] each
        unpack_tile(self.packed, self.layout, start, stop, codes)
        sz = self.scales_and_zeros[:, start:stop].float()  # [G, rows, 2]
        scale, zero8 = sz[..., 0], sz[..., 1] - 8 * sz[..., 0]
        groups = (self.in_features // GROUP_SIZE, GROUP_SIZE, stop - start)
        torch.addcmul(zero8[:, None], codes.view(groups), scale[:, None], out=tile.view(groups))
        return tile.t()  # [rows, K], a transposed view: F.linear takes it without a copy


class QuantizedEmbedding(nn.Module):
    """A token table held once, quantized; `logits` makes it the (tied) LM head.

    An int4 table stays in its kernel's layout and the lookup dequantizes just the looked-up rows from it: the
    lookup is small next to the step it feeds, so int4 models keep an int4 table rather than a larger int8 one
    (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md).
    """

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.dtype).view(*ids.shape, self.embedding_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self.table, hidden)


def lm_head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden @ W^T for an LM head that is a (tied) nn.Embedding, an nn.Linear, or a quantized one; a GGUF
    head's logits come back in fp32 (its sums are fp32: rounding them to bf16 would only cost a pass)."""
    if isinstance(head, nn.Embedding):
        return F.linear(hidden, head.weight)
    if isinstance(head, (QuantizedEmbedding, GGUFLinear, GGUFPlanesLinear)):
        return head.logits(hidden)  # a GGUF head returns fp32
    return head(hidden)


def quantized_module(scheme: str, weight, level: str | None, *, bias: torch.Tensor | None = None,
                     embedding: bool = False, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> nn.Module:
    """An Int8Linear / Int4Linear / GGUFLinear (or, for a token table, a QuantizedEmbedding holding one) of
    `weight`, in the layout the kernels of `level` compute with and bound to that level. Scheme "gguf" takes a
    GGUFWeight, "gguf_planes" GGUFPlanes (moved to `device`); given a float tensor (a weight the loader had to
    transform) either builds the dense layer instead."""
    if scheme in ("gguf", "gguf_planes") and not isinstance(weight, (GGUFWeight, GGUFPlanes)):
        return _dense_module(weight.to(device), bias, embedding, dtype)
    if scheme == "gguf_planes":
        layer = GGUFPlanesLinear([weight.to(device)], None if embedding else bias)
    elif scheme == "gguf":
        layer = GGUFLinear.from_blocks(weight, None if embedding else bias)
    elif scheme == "int8":
        layer = Int8Linear.from_float(weight, None if embedding else bias, native=quant_gemv.available(level))
    else:
        native = quant_gemv.native_layout_available(level)
        layer = Int4Linear.from_float(weight, None if embedding else bias, native=native,
                                      int8_activations=native and quant_gemv.q8_available(level))
    layer.use_kernel_level(level)
    return QuantizedEmbedding(layer, dtype) if embedding else layer


def _dense_module(weight: torch.Tensor, bias: torch.Tensor | None, embedding: bool, dtype: torch.dtype) -> nn.Module:
    weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if embedding:
        module = empty_embedding(*weight.shape, device="meta")
    else:
        module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        if bias is not None:
            module.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.to(dtype), requires_grad=False)
    module.weight = weight
    return module


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One layer computing the parts' outputs side by side ([..., N_1 + N_2 + ...]) from the same input, or
    None where they cannot be joined. Why: a decode matmul call costs time beyond streaming its weights, and
    q/k/v and gate/up are 5 of a Llama-family layer's 7 (measured:
    docs/benchmarks/2026-11-24-quantized-layer-crossovers.md). Dense nn.Linear (one GEMM over more columns:
    BLAS may block it differently, so fp32 sums can differ in the last bits from the separate products),
    Int8Linear and Int4Linear in the native layout (rows in blocks of 16; each output row computed exactly as
    before)."""
    joined = _concat_parts(parts)
    if isinstance(joined, KernelUser):  # the parts' level: the layout was chosen for it
        joined.use_kernel_level(parts[0].kernel_level)
    return joined


def _concat_parts(parts: list[nn.Module]) -> nn.Module | None:
    first = parts[0]
    if all(type(p) is GGUFLinear for p in parts):
        return concat_gguf_linears(parts)
    if all(type(p) is GGUFPlanesLinear for p in parts):
        return concat_planes_linears(parts)
    if (any(type(p) is not type(first) or p.in_features != first.in_features for p in parts)
            or any((p.bias is None) != (first.bias is None) for p in parts)):
        return None
    bias = None if first.bias is None else torch.cat([p.bias.detach() for p in parts])
    if type(first) is nn.Linear:
        joined = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=bias is not None,
                           device="meta")
        joined.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if bias is not None:
            joined.bias = nn.Parameter(bias, requires_grad=False)
        return joined
    if any(p.native != first.native or p.dense_from_rows != first.dense_from_rows for p in parts):
        return None
    if type(first) is Int8Linear:
        return Int8Linear(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), bias,
                          dense_from_rows=first.dense_from_rows, native=first.native)
    if (type(first) is Int4Linear and first.native
            and all(p.layout == first.layout and p.int8_activations == first.int8_activations for p in parts)
            and all(p.out_features % quant_gemv.BLOCK_ROWS == 0 for p in parts)):
        return Int4Linear(torch.cat([p.packed for p in parts]), torch.cat([p.scales_and_zeros for p in parts]),
                          first.layout, bias, dense_from_rows=first.dense_from_rows,
                          int8_activations=first.int8_activations)
    return None
