"""Weight-only int4 / int8 matmuls for decode-sized batches, through csrc/quant_gemv.cpp (and
csrc/quant_gemv_q8.cpp for int8 activations).

A decode step reads every weight once per token, so its matmuls are bound by memory bandwidth; torch's
_weight_int4pack_mm_for_cpu / _weight_int8pack_mm run far below it there. The C++ kernels compute what
torch's do (activations rounded to bf16, exact weights, fp32 sums) near the bandwidth.
measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md

int4 codes are kept in the kernel's own layout (blocks of 16 rows; see the .cpp header):

    codes [N, K/2] uint8    = [N/16][K/4][16 rows][2]: byte b of row r in chunk t holds k = 4t + b (low
                              nibble) and k = 4t + 2 + b (high nibble)
    sz    [N/16, G, 2, 16]  bf16: per block and 32-column group, the 16 rows' scales, then their zeros
    w[n, k] = (q - 8) * scale[n, k // 32] + zero[n, k // 32]

the same bytes as torch's int4pack layout (N*K/2 codes, 4 bytes of scale and zero per group). int8 weights
keep Int8Linear's [N, K] layout.

`available(at)` (the bf16-activation kernels) needs AVX-512 BF16; `q8_available(at)` (the int8-activation kernel, and
the layout's dequantizers) holds at every level (native.py) where a compiler is. Without them (native kernels
off, no compiler) layers keep torch's layouts and kernels (layers/quantized.py), which stay the reference.

`int4_matmul_q8` (every level, bit-identical across them) trades accuracy for speed: activations quantized to int8 per row and
32-column group (d = max|x| / 127, a = round(x / d)), int8 x int4 dot products exact in int32 (vpdpbusd: twice
the products per instruction of the bf16 kernel's vdpbf16ps), the rest fp32: faster than int4_matmul at the M
measured on layer shapes and the vocab head, at par on the head at one row where both stream from DRAM, with a
larger error than int4_matmul's (x in bf16). measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import FLOATS, DtypeCode, Function, Int, Tensor

BLOCK_ROWS = 16  # int4 rows per block of the layout
GROUP_SIZE = 32
_CHUNK_ROWS = 1024  # rows packed at a time at load (a multiple of BLOCK_ROWS)
_DTYPE_FLAG = native.DTYPE_CODES


def _matmul_function(symbol: str) -> Function:
    """x [M, K] @ W^T (+ bias) -> out [M, N]: the signature every matmul of this layout shares."""
    return Function(symbol, (Tensor("x", FLOATS), DtypeCode("x"), Int("M"), Int("K"), Tensor("weight"),
                             Tensor("scales"), Int("N"), Tensor("bias", FLOATS, optional=True), Tensor("out", FLOATS),
                             DtypeCode("out")))


_INT4, _INT8, _INT4_Q8 = map(_matmul_function, ("pagellm_int4_matmul", "pagellm_int8_matmul",
                                                "pagellm_int4_matmul_q8"))
_ROWS = Function("pagellm_int4_rows", (Tensor("codes"), Tensor("sz"), Int("N"), Int("K"), Tensor("ids", (torch.int64,)),
                                       Int("T"), Tensor("out", FLOATS), DtypeCode("out")), returns=ctypes.c_int64)
_TILE_T = Function("pagellm_int4_tile_t", (Tensor("codes"), Tensor("sz"), Int("K"), Int("first"), Int("rows"),
                                           Tensor("out", FLOATS, rows=True), Int("ld"), DtypeCode("out")))
_LAYOUT = native.Library("quant_gemv", [_ROWS, _TILE_T], "int4 weight layout")
_MATMULS = native.Library("quant_gemv", [_INT4, _INT8, native.RELEASE_SCRATCH], "int4/int8 x bf16 matmul", levels=("avx512",),
                          exports_if="pagellm_quant_gemv_vectorized")  # AVX-512 BF16
Q8_EXTENSIONS = ("avx_vnni",)  # built into the avx2 level's int8-activation kernel where the CPU has them
_Q8 = native.Library("quant_gemv_q8", [_INT4_Q8, native.RELEASE_SCRATCH], "int4 x int8 matmul", extensions=Q8_EXTENSIONS)
LIBRARIES = (_Q8, _LAYOUT, _MATMULS)  # for kernels/selection.py


def available(at: str | None) -> bool:
    """Whether the bf16-activation int4 / int8 kernels run at level `at` (avx512: AVX-512 BF16)."""
    return _MATMULS.available(at)


def promised(at: str | None) -> bool:
    """Whether the bf16-activation kernels exist at level `at`, built or not."""
    return _MATMULS.promised(at)


def q8_available(at: str | None) -> bool:
    """Whether int4_matmul_q8 (and with it the native int4 layout, whose dequantizers come with it) runs at
    level `at`: at every level with a compiler."""
    return _Q8.available(at) and _LAYOUT.available(at)


def native_layout_available(at: str | None) -> bool:
    """Whether int4 weights can be kept in this module's layout at level `at`: some kernel computes with it."""
    return available(at) or q8_available(at)


def _kernel(library: native.Library, symbol: str, at: str | None):
    fn = library.unchecked(symbol, at)
    if fn is None:  # the caller chose this path from available(at) / q8_available(at): not an input to fall back on
        raise RuntimeError(f"{library.title} does not run at level {at!r}")
    return fn


# ---- int4 layout ----------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K/2] uint8, sz [N/16, G, 2, 16] bf16) of codes q [N, K] (0..15) with scale and zero [N, G]
    (w = (q - 8) * scale + zero). N must be a multiple of 16 and K of 32."""
    rows, cols = q.shape
    groups = cols // GROUP_SIZE
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8)
    for start in range(0, rows, _CHUNK_ROWS):  # temporaries stay small
        part = q[start:start + _CHUNK_ROWS].reshape(-1, BLOCK_ROWS, cols // 4, 2, 2).permute(0, 2, 1, 4, 3)
        codes[start:start + _CHUNK_ROWS] = (part[..., 0] | (part[..., 1] << 4)).reshape(-1, cols // 2)  # [nb, t, r, b]
    pair = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)], dim=1)  # [N, 2, G]
    sz = pair.view(rows // BLOCK_ROWS, BLOCK_ROWS, 2, groups).permute(0, 3, 2, 1).contiguous()  # [nb, G, 2, 16]
    return codes, sz


def int4_codes(codes: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The codes [len(ids), K] of rows `ids`, in torch ops (the reference for the layout)."""
    rows, half_k = codes.shape
    ids = ids.reshape(-1).long()
    blocks = codes.view(rows // BLOCK_ROWS, half_k // 2, BLOCK_ROWS, 2)  # [nb, t, r, b]
    picked = blocks[ids // BLOCK_ROWS, :, ids % BLOCK_ROWS]  # [T, t, b]
    return torch.stack([picked & 15, picked >> 4], dim=2).view(len(ids), 2 * half_k)  # [T, t, h, b] -> [T, K]


def int4_scale_zero(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each [N, G] float32, of a packed sz [N/16, G, 2, 16]."""
    by_row = sz.permute(0, 3, 2, 1).reshape(-1, 2, sz.shape[1]).float()  # [N, 2, G]
    return by_row[:, 0], by_row[:, 1]


# ---- kernels --------------------------------------------------------------------------------------


def _matmul(fn, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            cols: int) -> torch.Tensor:
    """fn: a matmul's unchecked caller; x converted to what it takes, K checked."""
    if x.shape[-1] != cols or not x.is_cpu:  # the kernel reads raw memory: K must match
        raise ValueError(f"expected a CPU input of {cols} features, got {tuple(x.shape)} on {x.device}")
    if x.dtype not in _DTYPE_FLAG:  # torch's kernels too see only bf16 activations
        return _matmul(fn, x.to(torch.bfloat16), weight, scales, bias, cols).to(x.dtype)
    x = x.contiguous()
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    fn(x, x.numel() // cols, cols, weight, scales, weight.shape[0], bias, out)
    return out


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None,
                at: str | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype."""
    return _matmul(_kernel(_MATMULS, _INT4.symbol, at), x, codes, sz, bias, 2 * codes.shape[1])


def int4_matmul_q8(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None,
                   at: str | None) -> torch.Tensor:
    """int4_matmul with x quantized to int8 per row and 32-column group (see the module docstring): more
    throughput, at the cost of the activations' int8 rounding. Needs q8_available(at)."""
    return _matmul(_kernel(_Q8, _INT4_Q8.symbol, at), x, codes, sz, bias, 2 * codes.shape[1])


class BoundMatmul:
    """int4_matmul (or its int8-weight sibling, pagellm_int8_matmul: x [..., K] @ (qweight [N, K] int8 *
    scale [N] bf16)^T) bound to one layer's tensors, so a decode call is one allocation and one ctypes call:
    resolving a module's buffers and checking every argument per call cost a measurable share of a decode
    step. The owner checks `binds` before each use. `q8` (int4 only, where q8_available(at)) binds
    int4_matmul_q8 instead. measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md"""

    def __init__(self, scheme: str, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 q8: bool, at: str | None):
        if q8 and scheme != "int4":
            raise ValueError(f"the int8-activation kernel takes int4 weights, not {scheme}")
        self.tensors = (weight, scales, bias)
        self._fn = _kernel(_Q8, _INT4_Q8.symbol, at) if q8 else _kernel(_MATMULS, f"pagellm_{scheme}_matmul", at)
        self._rows, self._cols = weight.shape[0], weight.shape[1] * (2 if scheme == "int4" else 1)  # N, K

    def binds(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return self.tensors[0] is weight and self.tensors[1] is scales and self.tensors[2] is bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype, bias added."""
        bias = self.tensors[2]
        if (x.dtype not in _DTYPE_FLAG or not x.is_contiguous() or not x.is_cpu or x.shape[-1] != self._cols
                or (bias is not None and bias.dtype != x.dtype)):
            return _matmul(self._fn, x, *self.tensors, self._cols)  # the general path: checks and converts
        out = torch.empty((x.shape[0], self._rows) if x.dim() == 2 else (*x.shape[:-1], self._rows), dtype=x.dtype)
        self._fn(x, x.numel() // self._cols, self._cols, self.tensors[0], self.tensors[1], self._rows, bias, out)
        return out


def int4_rows(codes: torch.Tensor, sz: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
              at: str | None) -> torch.Tensor:
    """The dequantized rows `ids` into out [len(ids), K] (fp32 or bf16): exactly the weights the kernel uses."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    target = out if out.dtype in _DTYPE_FLAG and out.is_contiguous() else torch.empty(out.shape)
    bad = _kernel(_LAYOUT, _ROWS.symbol, at)(codes, sz, codes.shape[0], 2 * codes.shape[1], ids, ids.numel(), target)
    if bad:  # checked in the kernel: a reduction and a host read here cost more than the lookup
        raise IndexError(f"{bad} row index(es) out of range for {codes.shape[0]} rows")
    return out if target is out else out.copy_(target)


def int4_tile_t(codes: torch.Tensor, sz: torch.Tensor, start: int, stop: int, out: torch.Tensor,
                at: str | None) -> torch.Tensor:
    """Rows [start, stop) (multiples of 16) dequantized and transposed into out [K, stop - start] (fp32 or bf16;
    a column slice of a wider buffer is fine): the dense path's weight tile, as tile.t()."""
    rows, cols = stop - start, 2 * codes.shape[1]
    if start % BLOCK_ROWS or rows % BLOCK_ROWS or not 0 <= start < stop <= codes.shape[0]:
        raise IndexError(f"rows [{start}, {stop}) of {codes.shape[0]} are not whole blocks of {BLOCK_ROWS}")
    if out.dtype not in _DTYPE_FLAG or out.stride(1) != 1:
        return out.copy_(int4_tile_t(codes, sz, start, stop, torch.empty(cols, rows), at))
    _kernel(_LAYOUT, _TILE_T.symbol, at)(codes, sz, cols, start, rows, out, out.stride(0))
    return out
