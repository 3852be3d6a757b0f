"""GGUF block formats kept in their file's bits, and their matmul with int8 activations (csrc/quant_gguf.cpp).

Each format is, per row and 32-column group, integer codes and fp32 factors: w = scale * (q - zero) (+ min). A
GGUFWeight holds a tensor's codes and factors laid out for the kernel (csrc/gguf_format.h); the loader makes it
from the file's blocks (loader/gguf_repack.py, where the formats' byte layouts are described).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagellm.kernels.build import native
from pagellm.kernels.build.binding import FLOATS, Address, DtypeCode, Flag, Float, Function, Int, Tensor

T = gguf.GGMLQuantizationType
BLOCK_ROWS = 16
GROUP_SIZE = 32
FORMAT_IDS = {T.Q4_0: 0, T.Q4_1: 1, T.Q5_0: 2, T.Q5_1: 3, T.Q8_0: 4, T.Q4_K: 5, T.Q5_K: 6, T.Q6_K: 7}

_BLOCKS = (Flag("format"), Tensor("qs"), Tensor("gp"), Tensor("sp"))  # a GGUFWeight's format and tensors
# the output (and bias) are addresses: a joined layer's parts write side by side into one output, at offsets
_MATMUL = Function("pagellm_gguf_matmul_q8", (
    Tensor("x", FLOATS), DtypeCode("x"), Int("M"), Int("K"), *_BLOCKS, Int("N"), Int("ldo"), Address("bias"),
    Address("out"), Flag("out_dtype")), returns=ctypes.c_int)
_MLP = Function("pagellm_gguf_mlp", (
    Tensor("x", FLOATS), DtypeCode("x"), Int("M"), Int("K"), *_BLOCKS, Int("I"), Address("bias"), Flag("act"),
    Flag("down_format"), Tensor("down_qs"), Tensor("down_gp"), Tensor("down_sp"), Int("N"), Address("down_bias"),
    Tensor("out", FLOATS), DtypeCode("out")), returns=ctypes.c_int)
_NORM_ARGS = (Tensor("residual", FLOATS), Tensor("post_weight", FLOATS, optional=True), Tensor("weight", FLOATS),
              Float("eps"), Flag("unit_offset"), Tensor("residual_out", FLOATS), Tensor("out", FLOATS),
              DtypeCode("out"))  # a residual add + RMSNorm after the product, as layer_ops.add_rms_norm
_MATMUL_ADD_NORM = Function("pagellm_gguf_matmul_add_norm", (
    Tensor("x", FLOATS), DtypeCode("x"), Int("M"), Int("K"), *_BLOCKS, Int("N"), Address("bias"), *_NORM_ARGS),
    returns=ctypes.c_int)
_MLP_ADD_NORM = Function("pagellm_gguf_mlp_add_norm", (*_MLP.args[:-2], *_NORM_ARGS), returns=ctypes.c_int)
# bytes from one expert's arrays to the next's
_STRIDES = tuple(Int(f"{part}_stride") for part in ("qs", "gp", "sp"))
_DOWN_STRIDES = tuple(Int(f"down_{part}_stride") for part in ("qs", "gp", "sp"))
_FP32 = (torch.float32,)
_MOE = Function("pagellm_gguf_moe", (
    Tensor("x", _FP32), Int("T"), Int("K"), Tensor("ids", (torch.int64,)), Tensor("weights", _FP32), Int("k"),
    Int("X"), *_BLOCKS, *_STRIDES, Int("I"), Flag("act"), Flag("down_format"), Tensor("down_qs"), Tensor("down_gp"),
    Tensor("down_sp"), *_DOWN_STRIDES, Int("N"), Tensor("out", _FP32)), returns=ctypes.c_int)
_ROWS = Function("pagellm_gguf_rows", (*_BLOCKS, Int("N"), Int("K"), Tensor("ids", (torch.int64,)), Int("T"),
                                       Tensor("out", FLOATS), DtypeCode("out")), returns=ctypes.c_int64)
_KERNELS = native.Library("quant_gguf", [_MATMUL, _MATMUL_ADD_NORM, _MLP, _MLP_ADD_NORM, _MOE, _ROWS,
                                         native.RELEASE_SCRATCH],
                          "GGUF blocks x int8 matmul", extensions=("avx_vnni",))
LIBRARIES = (_KERNELS,)  # for kernels/selection.py
_DTYPE_FLAG = native.DTYPE_CODES


def available(at: str | None) -> bool:
    """Whether the kernels run at level `at`: at every level with a compiler (None: native kernels off)."""
    return _KERNELS.available(at)


def _kernel(symbol: str, at: str | None):
    fn = _KERNELS.unchecked(symbol, at)
    if fn is None:  # weights kept in blocks have no other path: the loader keeps them only where this runs
        raise RuntimeError(f"GGUF block weights need the native kernels, which do not run at level {at!r} "
                           "(native kernels off, or no C++ compiler)")
    return fn


@dataclass
class GGUFWeight:
    """A [rows, cols] GGUF tensor repacked for the kernels (csrc/gguf_format.h): qs, gp, sp uint8."""

    ggml_type: T
    rows: int
    cols: int
    qs: torch.Tensor  # [rows/16, G, group bytes] codes
    gp: torch.Tensor  # [rows/16, G, param bytes] per-group factors
    sp: torch.Tensor  # [rows/16, cols/256, super bytes] per-256-column factors (empty for 32-column formats)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def format_id(self) -> int:
        return FORMAT_IDS[self.ggml_type]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qs, self.gp, self.sp


# ---- kernels ------------------------------------------------------------------------------------------------


class BoundMatmul:
    """The matmul of one or more weights side by side (same K; their outputs concatenated), bound to their
    tensors: a decode call is one allocation and one ctypes call per weight. Why several: a joined q/k/v or
    gate/up whose parts the file stores in different formats still writes one output, with no copies."""

    def __init__(self, weights: list[GGUFWeight], bias: torch.Tensor | None, at: str | None):
        self.weights, self.bias = list(weights), bias
        self.cols, self.rows = weights[0].cols, sum(w.rows for w in weights)
        if any(w.cols != self.cols for w in weights):
            raise ValueError(f"weights side by side need one input width, got {[w.cols for w in weights]}")
        self._fn = _kernel(_MATMUL.symbol, at)
        self._add_norm = _kernel(_MATMUL_ADD_NORM.symbol, at)
        self.at = at
        offsets = np.cumsum([0] + [w.rows for w in weights])[:-1].tolist()
        self._calls = [(int(o), (w.format_id, w.qs, w.gp, w.sp, w.rows)) for o, w in zip(offsets, weights)]
        self._biases = {}  # dtype -> the bias in it

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] (fp32 or bf16, CPU) -> [..., N] in out_dtype (fp32 or bf16; default x's), bias added. The
        sums are fp32 either way: an fp32 output of bf16 activations is those sums unrounded (an LM head's)."""
        cols = self.cols
        if x.shape[-1] != cols or not x.is_cpu:  # the kernel reads raw memory: K must match
            raise ValueError(f"expected a CPU input of {cols} features, got {tuple(x.shape)} on {x.device}")
        if x.dtype not in _DTYPE_FLAG:
            return self(x.float(), torch.float32).to(out_dtype or x.dtype)
        out_dtype = out_dtype or x.dtype
        if out_dtype not in _DTYPE_FLAG:
            return self(x, torch.float32).to(out_dtype)
        x = x.contiguous()
        out = torch.empty(*x.shape[:-1], self.rows, dtype=out_dtype)
        bias = self._bias_in(out_dtype)
        size, rows, out_at, code = out.element_size(), x.numel() // cols, out.data_ptr(), _DTYPE_FLAG[out_dtype]
        for offset, args in self._calls:
            self._fn(x, rows, cols, *args, self.rows, None if bias is None else bias + offset * size,
                     out_at + offset * size, code)
        return out

    def fuses_add_norm(self) -> bool:
        """Whether add_norm takes this matmul: one weight (a joined layer of several formats writes at offsets)."""
        return len(self._calls) == 1

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                 weight: torch.Tensor, eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = residual + post(x W^T + bias), in one call: layer_ops.add_rms_norm after this
        matmul, the same bits (csrc/quant_gguf.cpp's pagellm_gguf_matmul_add_norm). x [..., K] fp32 or bf16;
        residual [..., N] fp32 or bf16, the product's dtype; the norm weights as add_rms_norm takes them."""
        if (x.shape[-1] != self.cols or x.dtype not in _DTYPE_FLAG or not x.is_cpu or residual.dtype not in
                _DTYPE_FLAG or residual.shape != (*x.shape[:-1], self.rows) or not self.fuses_add_norm()):
            raise ValueError(f"expected one weight, x [..., {self.cols}] and a residual [..., {self.rows}] on the "
                             f"CPU in fp32 or bf16; got {len(self._calls)} weights, {tuple(x.shape)} {x.dtype}, "
                             f"{tuple(residual.shape)} {residual.dtype}")
        x, residual = x.contiguous(), residual.contiguous()
        new_residual, out = torch.empty_like(residual), torch.empty_like(residual)
        format_id, qs, gp, sp, _ = self._calls[0][1]
        if self._add_norm(x, x.numel() // self.cols, self.cols, format_id, qs, gp, sp, self.rows,
                          self._bias_in(residual.dtype), residual, post_weight, weight, eps, int(unit_offset),
                          new_residual, out):
            raise RuntimeError(f"pagellm_gguf_matmul_add_norm refused format {self.weights[0].ggml_type!r}")
        return new_residual, out

    def _bias_in(self, dtype: torch.dtype) -> int | None:
        if self.bias is None:
            return None
        if dtype not in self._biases:
            self._biases[dtype] = self.bias.detach().to(dtype).contiguous()
        return self._biases[dtype].data_ptr()


class BoundMLP:
    """A gated MLP whose joined gate/up projection (gate rows first, one format) and down projection are GGUF
    blocks, in one call: x [..., K] -> down(act(gate) * up) [..., N] in x's dtype, the bits of the three calls
    with the intermediates in x's dtype, neither of them stored (csrc/quant_gguf.cpp's pagellm_gguf_mlp)."""

    def __init__(self, gate_up: BoundMatmul, down: BoundMatmul, activation: int):
        if not self.fuses(gate_up, down) or activation not in (0, 1):
            raise ValueError(f"a fused MLP takes a one-format gate/up of 2I rows (I a multiple of {GROUP_SIZE}), a "
                             f"one-format down of I columns and activation 0 or 1; got {len(gate_up.weights)} and "
                             f"{len(down.weights)} segment(s), {gate_up.rows} rows, {down.cols} columns, activation "
                             f"{activation}")
        self.gate_up, self.down, self.activation = gate_up, down, activation
        self._fn = _kernel(_MLP.symbol, gate_up.at)
        self._add_norm = _kernel(_MLP_ADD_NORM.symbol, gate_up.at)

    @staticmethod
    def fuses(gate_up: BoundMatmul, down: BoundMatmul) -> bool:
        return (len(gate_up.weights) == 1 and len(down.weights) == 1 and gate_up.rows % (2 * GROUP_SIZE) == 0
                and down.cols == gate_up.rows // 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self._checked(x)
        out = torch.empty(*x.shape[:-1], self.down.rows, dtype=x.dtype)
        if self._fn(*self._args(x), out):
            raise RuntimeError(self._refused())
        return out

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                 weight: torch.Tensor, eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = residual + post(self(x)), in one call: layer_ops.add_rms_norm after this MLP, the
        same bits (csrc/quant_gguf.cpp's pagellm_gguf_mlp_add_norm); a layer's MLP with the next layer's input
        norm. residual [..., N] in x's dtype; the norm weights as add_rms_norm takes them."""
        x = self._checked(x)
        if residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], self.down.rows):
            raise ValueError(f"expected a residual [..., {self.down.rows}] in {x.dtype}, got {tuple(residual.shape)} "
                             f"{residual.dtype}")
        residual = residual.contiguous()
        new_residual, out = torch.empty_like(residual), torch.empty_like(residual)
        if self._add_norm(*self._args(x), residual, post_weight, weight, eps, int(unit_offset), new_residual, out):
            raise RuntimeError(self._refused())
        return new_residual, out

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.gate_up.cols or not x.is_cpu or x.dtype not in _DTYPE_FLAG:
            raise ValueError(f"expected a CPU fp32 or bf16 input of {self.gate_up.cols} features, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        return x.contiguous()

    def _args(self, x: torch.Tensor) -> tuple:
        """The kernels' arguments up to the output: x, the two weights, their biases in x's dtype."""
        gate_up, down = self.gate_up, self.down
        format_id, qs, gp, sp, _ = gate_up._calls[0][1]
        down_format, down_qs, down_gp, down_sp, _ = down._calls[0][1]
        return (x, x.numel() // gate_up.cols, gate_up.cols, format_id, qs, gp, sp, down.cols,
                gate_up._bias_in(x.dtype), self.activation, down_format, down_qs, down_gp, down_sp, down.rows,
                down._bias_in(x.dtype))

    def _refused(self) -> str:
        return (f"pagellm_gguf_mlp refused formats {self.gate_up.weights[0].ggml_type!r}, "
                f"{self.down.weights[0].ggml_type!r}")


def rows(weight: GGUFWeight, ids: torch.Tensor, at: str | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized rows `ids` [T, K] (fp32 or bf16): exactly gguf.quants.dequantize's values."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), weight.cols, dtype=dtype if dtype in _DTYPE_FLAG else torch.float32)
    bad = _kernel(_ROWS.symbol, at)(weight.format_id, *weight.tensors(), weight.rows, weight.cols, ids,
                                           ids.numel(), out)
    if bad:  # checked in the kernel: a reduction and a host read here cost more than the lookup
        raise IndexError(f"{bad} row index(es) out of range for {weight.rows} rows")
    return out.to(dtype)


def matmul(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None, at: str | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, x quantized to int8 per 32 columns."""
    return BoundMatmul([weight], bias, at)(x)


class BoundMoe:
    """A MoE layer's routed experts in one call (csrc/quant_gguf.cpp's pagellm_gguf_moe): x [T, K] fp32, ids /
    weights [T, k] -> Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]) [T, N] fp32, each expert computed as BoundMLP
    computes it, once over its tokens' rows, and the sum in ascending expert id (ids outside [0, X) skipped): the
    bits of the loop over the experts and of the grouped path. gate_up, down: (format id, qs, gp, sp) of the
    stacked arrays [X, rows / 16, ...]; activation as BoundMLP's."""

    def __init__(self, gate_up: tuple, down: tuple, activation: int, at: str | None):
        (self.format_id, *self.arrays), (self.down_format, *self.down_arrays) = gate_up, down
        self.intermediate = self.arrays[0].shape[1] * BLOCK_ROWS // 2
        self.hidden = self.down_arrays[0].shape[1] * BLOCK_ROWS
        # bytes from one expert's arrays to the next's (0 for an empty array: a format without sub-scales)
        self.strides = [a.stride(0) * a.element_size() if a.numel() else 0 for a in (*self.arrays, *self.down_arrays)]
        self.activation, self._fn = activation, _kernel(_MOE.symbol, at)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x, weights = x.to(torch.float32).contiguous(), weights.to(torch.float32).contiguous()
        ids = ids.to(torch.int64).contiguous()  # the kernel reads int64 ids unchecked
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        if self._fn(x, x.shape[0], x.shape[1], ids, weights, ids.shape[1], self.arrays[0].shape[0], self.format_id,
                    *self.arrays, *self.strides[:3], self.intermediate, self.activation, self.down_format,
                    *self.down_arrays, *self.strides[3:], self.hidden, out):
            raise RuntimeError(f"pagellm_gguf_moe refused formats {self.format_id} and {self.down_format}, or the "
                               f"activation {self.activation}, or its shapes")
        return out
