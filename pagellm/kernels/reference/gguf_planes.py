"""GGUF tensors as a GPU keeps them: the file's codes and factors in planes, one row after another, and their
dequantization in torch (the oracle of the Triton kernels in kernels/gpu/gguf_matmul.py).

Why planes and not the file's blocks as they are: a block of 18, 22, 34 or 210 bytes leaves the codes of a row
aligned on 2 bytes, and a GPU reads them a byte at a time; split into planes, each row's codes are one aligned
run of bytes that loads in wide vectors. Nothing is re-rounded: the planes hold the file's own bits, and their
bytes are the file's (Q4_K and Q5_K: their 6-bit scales unpacked to a byte each, 148 and 180 bytes where the
file has 144 and 176; every other format byte for byte).

Planes of a [N, K] tensor (c: a column; each row's planes laid out alike):
    qs  uint8 [N, K / 2]: the low 4 bits of the codes, the file's nibble bytes in order. Runs of RUN bytes: byte
        l of run r holds column 2 RUN r + l in its low nibble and column 2 RUN r + RUN + l in its high one (RUN
        16 for Q4_0, Q4_1, Q5_0, Q5_1; 32 for Q4_K and Q5_K; 64 for Q6_K). Q8_0: int8 [N, K], the codes.
    qh  the code bits above 4: Q5_0 / Q5_1 int32 [N, K / 32] (bit c % 32); Q5_K uint8 [N, K / 8] (bit
        (c % 256) // 32 of byte 32 (c // 256) + c % 32); Q6_K uint8 [N, K / 4] (2 bits at 2 ((c % 128) // 32) of
        byte 64 (c // 256) + 32 ((c % 256) // 128) + c % 32). Empty [N, 0] for the rest.
    sc  Q4_K / Q5_K uint8 [N, K / 32] sub-block scales; Q6_K int8 [N, K / 16]; empty otherwise.
    mn  Q4_K / Q5_K uint8 [N, K / 32] sub-block mins; empty otherwise.
    d   float16 [N, K / 32] (legacy formats) or [N, K / 256] (K formats): the file's d.
    dm  float16: Q4_1 / Q5_1 m [N, K / 32]; Q4_K / Q5_K dmin [N, K / 256]; empty otherwise.

    Q4_0  d (q - 8)     Q4_1  d q + m     Q5_0  d (q - 16)     Q5_1  d q + m     Q8_0  d q
    Q4_K, Q5_K  (d sc) q - (dmin mn)       Q6_K  (d sc) (q - 32)        (each product in float32, as gguf's)
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
import torch.nn.functional as F

T = gguf.GGMLQuantizationType
RUNS = {T.Q4_0: 16, T.Q4_1: 16, T.Q5_0: 16, T.Q5_1: 16, T.Q8_0: 0, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 64}
FORMATS = tuple(RUNS)  # every format the CPU's block kernels take, in the order the Triton kernels number them
PLANES = ("qs", "qh", "sc", "mn", "d", "dm")


@dataclass
class GGUFPlanes:
    """A [rows, cols] GGUF tensor in planes (the module docstring); rows concatenate plane by plane."""

    ggml_type: T
    rows: int
    cols: int
    qs: torch.Tensor
    qh: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dm: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in PLANES)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> GGUFPlanes:
        return GGUFPlanes(self.ggml_type, self.rows, self.cols, *(t.to(device) for t in self.tensors()))


def joined(parts: list[GGUFPlanes]) -> GGUFPlanes:
    """The planes of parts of one format and width stacked by rows (a fused q/k/v's or gate/up's segment)."""
    first = parts[0]
    if any(p.ggml_type != first.ggml_type or p.cols != first.cols for p in parts):
        raise ValueError("planes join only within one format and width")
    return GGUFPlanes(first.ggml_type, sum(p.rows for p in parts), first.cols,
                      *(torch.cat(tensors) for tensors in zip(*(p.tensors() for p in parts))))


def supports(ggml_type: T, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] tensor of this type can be kept in planes (any rows; whole blocks per row)."""
    return ggml_type in RUNS and rows > 0 and cols % gguf.GGML_QUANT_SIZES[ggml_type][0] == 0


def codes(planes: GGUFPlanes) -> torch.Tensor:
    """[N, K] int32 codes (the bits above 4 included; Q8_0's signed)."""
    t, n, k = planes.ggml_type, planes.rows, planes.cols
    if t == T.Q8_0:
        return planes.qs.to(torch.int32)
    run = RUNS[t]
    nib = planes.qs.to(torch.int32).view(n, k // (2 * run), 1, run)
    q = torch.cat([nib & 15, nib >> 4], dim=2).view(n, k)  # [N, runs, low | high, RUN] -> column order
    col = torch.arange(k, device=planes.qs.device)
    if t in (T.Q5_0, T.Q5_1):
        q = q | (((planes.qh.to(torch.int32)[:, col // 32] >> (col % 32)) & 1) << 4)
    elif t == T.Q5_K:
        q = q | (((planes.qh.to(torch.int32)[:, (col // 256) * 32 + col % 32] >> ((col % 256) // 32)) & 1) << 4)
    elif t == T.Q6_K:
        byte = (col // 256) * 64 + 32 * ((col % 256) // 128) + col % 32
        q = q | (((planes.qh.to(torch.int32)[:, byte] >> (2 * ((col % 128) // 32))) & 3) << 4)
    return q


def dequantize(planes: GGUFPlanes) -> torch.Tensor:
    """[N, K] float32, bit for bit gguf.quants.dequantize of the file's blocks."""
    t, k = planes.ggml_type, planes.cols
    q = codes(planes).float()
    col = torch.arange(k, device=q.device)
    d = planes.d.float()
    if t in (T.Q4_K, T.Q5_K):
        scale = d[:, col // 256] * planes.sc.float()[:, col // 32]
        return scale * q - planes.dm.float()[:, col // 256] * planes.mn.float()[:, col // 32]
    if t == T.Q6_K:
        return (d[:, col // 256] * planes.sc.float()[:, col // 16]) * (q - 32)
    d = d[:, col // 32]
    if t in (T.Q4_1, T.Q5_1):
        return d * q + planes.dm.float()[:, col // 32]
    return d * (q - {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 0}[t])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 codes [M, K] and fp32 scales [M, K / 32]: per 32 columns d = max |x| / 127 and codes x / d
    rounded half to even (0 where d is), as the CPU kernels quantize activations (the oracle of
    kernels/gpu/gguf_gemv_q8.quantize_rows)."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(-1) / 127
    scaled = groups / torch.where(d > 0, d, 1.0)[..., None]
    return torch.round(scaled).clamp(-127, 127).to(torch.int8).reshape(x.shape), d


class ReferencePlanesMatmul:
    """y = x W^T + b over segments of planes side by side, through the dense weight dequantized at each call:
    the oracle of kernels/gpu/gguf_matmul.BoundPlanesMatmul (the same contract), and a CPU's way through a
    model planned for a GPU (tests)."""

    def __init__(self, segments: list[GGUFPlanes], bias: torch.Tensor | None):
        self.segments, self.bias = segments, bias

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = torch.cat([dequantize(s) for s in self.segments])
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), weight, bias).to(out_dtype or x.dtype)


def rows(planes: GGUFPlanes, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized rows `ids` [T] -> [T, K] in `dtype` (a token table's lookup)."""
    return dequantize(planes)[ids].to(dtype)
