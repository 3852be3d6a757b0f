"""GGUF block formats kept in their file's bits, and their matmul with int8 activations (csrc/quant_gguf.cpp).

Each format is, per row and 32-column group, integer codes and fp32 factors: w = scale * (q - zero) (+ min).
`repack` reads a tensor's raw blocks and lays those same codes and factors out for the kernel (the layout:
csrc/gguf_format.h): 16 rows per block, the low nibbles as pagellm's int4 layout, code bits above 4 as bit
planes (Q6_K's two as quads of chunks), scales per group and, for K formats, per 256 columns. Nothing is
re-rounded, and the bytes stay within 3% of the file's (Q4_K: 148 per 144; the unpacked 6-bit scales cost the
rest).

Blocks as the file stores them (sizes in bytes; codes of a block in column order unless said):
    Q4_0  32: d f16 | 16 nibble bytes (low nibbles columns 0-15, high 16-31)       w = d (q - 8)
    Q4_1  32: d, m f16 | 16 nibble bytes                                           w = d q + m
    Q5_0  32: d f16 | qh u32 (bit k: column k's 5th bit) | 16 nibble bytes         w = d (q - 16)
    Q5_1  32: d, m f16 | qh u32 | 16 nibble bytes                                  w = d q + m
    Q8_0  32: d f16 | 32 int8                                                      w = d q
    Q4_K  256: d, dmin f16 | 12 bytes of eight 6-bit (sc, m) | 128 nibble bytes in runs of 32 (run i: low
          nibbles sub-block 2i, high 2i + 1)                                     w = d sc q - dmin m per 32
    Q5_K  256: as Q4_K, with qh[32] before the nibbles (bit s of qh[l]: sub-block s, column l's 5th bit)
    Q6_K  256: ql[128] | qh[64] | int8 sc[16] | d f16; column 128h + 32j + l: low nibble of ql[64h + l + 32(j % 2)]
          (high nibble for j >= 2), top 2 bits (qh[32h + l] >> 2j) & 3          w = d sc (q - 32) per 16
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagellm.kernels import native
from pagellm.kernels.binding import FLOATS, Address, DtypeCode, Flag, Float, Function, Int, Tensor

T = gguf.GGMLQuantizationType
BLOCK_ROWS = 16
GROUP_SIZE = 32
FORMAT_IDS = {T.Q4_0: 0, T.Q4_1: 1, T.Q5_0: 2, T.Q5_1: 3, T.Q8_0: 4, T.Q4_K: 5, T.Q5_K: 6, T.Q6_K: 7}
_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}
_SUPER = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})  # 256-column blocks with per-block factors
_CHUNK_ROWS = 1024  # rows repacked at a time: temporaries stay small

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
_ROWS = Function("pagellm_gguf_rows", (*_BLOCKS, Int("N"), Int("K"), Tensor("ids", (torch.int64,)), Int("T"),
                                       Tensor("out", FLOATS), DtypeCode("out")), returns=ctypes.c_int64)
_KERNELS = native.Library("quant_gguf", [_MATMUL, _MATMUL_ADD_NORM, _MLP, _MLP_ADD_NORM, _ROWS,
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


def supports(ggml_type: T, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] tensor of this type can stay in its blocks: a kernel format, whole 16-row blocks."""
    return ggml_type in FORMAT_IDS and rows % BLOCK_ROWS == 0 and cols % GROUP_SIZE == 0


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


def repack(data: np.ndarray, ggml_type: T, shape: tuple[int, int],
           consumed: Callable[[int, int], None] | None = None) -> GGUFWeight:
    """The GGUFWeight of a [rows, cols] tensor from its raw block bytes (`data`, as the file stores them).
    consumed(first_row, end_row) is called once those rows of `data` are read and will not be read again."""
    rows, cols = shape
    if not supports(ggml_type, rows, cols):
        raise ValueError(f"a {ggml_type.name} tensor of shape {shape} cannot be kept in its blocks "
                         f"(formats {sorted(t.name for t in FORMAT_IDS)}, rows a multiple of {BLOCK_ROWS})")
    by_row = np.asarray(data).reshape(rows, -1)
    out = None  # filled chunk by chunk: a big tensor (a 128k-row vocab head) is never held twice
    for start in range(0, rows, _CHUNK_ROWS):
        parts = _repack_rows(by_row[start:start + _CHUNK_ROWS], ggml_type, cols)
        if out is None:
            out = [np.empty((rows // BLOCK_ROWS, *p.shape[1:]), np.uint8) for p in parts]
        for whole, part in zip(out, parts):
            whole[start // BLOCK_ROWS:start // BLOCK_ROWS + part.shape[0]] = part
        if consumed is not None:
            consumed(start, min(start + _CHUNK_ROWS, rows))
    qs, gp, sp = (torch.from_numpy(t) for t in out)
    return GGUFWeight(ggml_type, rows, cols, qs, gp, sp)


def _repack_rows(by_row: np.ndarray, ggml_type: T, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = by_row.shape[0]
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    codes, group_factors, super_factors = _DECODERS[ggml_type](by_row.reshape(-1, type_size))
    codes = codes.reshape(n, cols)
    bits = _BITS[ggml_type]
    qs = _code_bytes(codes, bits)
    gp = _by_block(group_factors.reshape(n, cols // GROUP_SIZE, -1))
    sp = (_by_block(super_factors.reshape(n, cols // 256, -1)) if ggml_type in _SUPER
          else np.zeros((n // BLOCK_ROWS, 0, 0), np.uint8))
    return qs, gp, sp


def _by_block(factors: np.ndarray) -> np.ndarray:
    """[n, groups, S] factors -> [n/16, groups, S * 16 * itemsize] bytes: per group, S runs of the 16 rows'."""
    n, groups, kinds = factors.shape
    blocked = factors.reshape(n // BLOCK_ROWS, BLOCK_ROWS, groups, kinds).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(blocked).view(np.uint8).reshape(n // BLOCK_ROWS, groups, -1)


def _code_bytes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[n, K] codes -> [n/16, G, group bytes] as gguf_format.h lays them out."""
    n, cols = codes.shape
    per_chunk = codes.reshape(n // BLOCK_ROWS, BLOCK_ROWS, cols // GROUP_SIZE, 8, 4)  # [nb, r, g, t, b]
    if bits == 8:
        return np.ascontiguousarray(per_chunk.transpose(0, 2, 3, 1, 4)).view(np.uint8).reshape(
            n // BLOCK_ROWS, cols // GROUP_SIZE, 512)
    low = (per_chunk & 15).astype(np.uint8).reshape(*per_chunk.shape[:4], 2, 2)  # [.., t, high?, b']
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)  # [nb, g, t, r, b']
    parts = [nibbles.reshape(n // BLOCK_ROWS, cols // GROUP_SIZE, 256)]
    if bits == 6:  # two high bits as quads: chunk 4j + c's at bits 8b + 2c, 8b + 2c + 1 of quad j
        high = ((per_chunk >> 4) & 3).astype(np.uint32).reshape(*per_chunk.shape[:3], 2, 4, 4)  # [.., j, c, b]
        quads = (high << (8 * np.arange(4) + 2 * np.arange(4)[:, None]).astype(np.uint32)).sum(
            axis=(4, 5), dtype=np.uint32)  # [nb, r, g, j]
        parts.append(np.ascontiguousarray(quads.transpose(0, 2, 3, 1)).view(np.uint8).reshape(
            n // BLOCK_ROWS, cols // GROUP_SIZE, 128))  # [nb, g, j, r] uint32
        return np.concatenate(parts, axis=2)
    shifts = (8 * np.arange(4)[None, :] + np.arange(8)[:, None]).astype(np.uint32)  # [t, b]: bit 8b + t
    for bit in range(4, bits):
        plane = (((per_chunk.astype(np.uint32) >> bit) & 1) << shifts).sum(axis=(3, 4), dtype=np.uint32)  # [nb, r, g]
        parts.append(np.ascontiguousarray(plane.transpose(0, 2, 1)).view(np.uint8))  # [nb, g, 64]
    return np.concatenate(parts, axis=2)


# ---- the file's blocks -> (codes [blocks, 32 or 256], group factors, super factors) --------------------------


def _u16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.uint16)  # [blocks, 1] f16 bits


def _nibbles(code_bytes: np.ndarray, run: int) -> np.ndarray:
    """[blocks, bytes] -> [blocks, 2 * bytes]: each run of bytes gives its low nibbles, then its high."""
    runs = code_bytes.reshape(code_bytes.shape[0], -1, 1, run)
    return ((runs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(code_bytes.shape[0], -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian u32 -> [blocks, 32]: bit k << 4."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # [blocks, 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _legacy(blocks: np.ndarray, has_min: bool, has_fifth: bool):
    factors = [_u16(blocks, 0)] + ([_u16(blocks, 2)] if has_min else [])
    at = 4 if has_min else 2
    codes = _nibbles(blocks[:, at + (4 if has_fifth else 0):], run=16)
    if has_fifth:
        codes = codes | _fifth_bits(blocks[:, at:at + 4])
    return codes, np.concatenate(factors, axis=1), None


def _q8_0(blocks: np.ndarray):
    return np.ascontiguousarray(blocks[:, 2:34]).view(np.int8), _u16(blocks, 0), None


def _k_quant(blocks: np.ndarray, has_fifth: bool):
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))  # [blocks, 8] each (Q5_K alike)
    codes = _nibbles(blocks[:, 48 if has_fifth else 16:], run=32)  # [blocks, 256]
    if has_fifth:
        qh = blocks[:, 16:48]  # [blocks, 32]: bit s of byte l is sub-block s, column l
        codes = codes | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4).reshape(-1, 256)
    group = np.stack([sc.astype(np.uint8), m.astype(np.uint8)], axis=2)  # [blocks, 8, 2]
    return codes, group, np.concatenate([_u16(blocks, 0), _u16(blocks, 2)], axis=1)


def _q6_k(blocks: np.ndarray):
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [blocks, half, j % 2, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [blocks, half, 1, l]
    low = np.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)  # [b, h, j, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high << 4)).reshape(-1, 256)
    return codes, np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).reshape(-1, 8, 2), _u16(blocks, 208)


_DECODERS = {
    T.Q4_0: lambda b: _legacy(b, has_min=False, has_fifth=False),
    T.Q4_1: lambda b: _legacy(b, has_min=True, has_fifth=False),
    T.Q5_0: lambda b: _legacy(b, has_min=False, has_fifth=True),
    T.Q5_1: lambda b: _legacy(b, has_min=True, has_fifth=True),
    T.Q8_0: _q8_0,
    T.Q4_K: lambda b: _k_quant(b, has_fifth=False),
    T.Q5_K: lambda b: _k_quant(b, has_fifth=True),
    T.Q6_K: _q6_k,
}


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
