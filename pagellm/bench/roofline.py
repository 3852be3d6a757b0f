"""The machine's roofline, measured with torch, and where a measured figure sits under it.

    peak GEMM  : FLOP/s of a large square matmul in the compute dtype (best of a few)
    int8 GEMM  : op/s of the same matmul in int8 (torch._int_mm, VNNI on x86), the peak of int4 layers that
                 take int8 activations (layers/quantized.py)
    bandwidth  : bytes/s of a sum over a tensor far larger than the caches (best of a few)

A step that runs N tokens through the model's weights needs at least
    max(weight_bytes / bandwidth, 2 * matmul_params * N / peak)
seconds (attention and the KV reads are left out: small next to the weights at
these context lengths). Single-stream decode sits on the bandwidth side, large
batches and prefill on the GEMM side; a figure's "% of roofline" is that bound
divided by the time the step actually took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Roofline:
    gemm_flops: float  # FLOP/s
    read_bytes_per_s: float
    dtype: str
    int8_gemm_ops: float | None = None  # op/s; None where torch has no int8 matmul here

    def describe(self) -> str:
        int8 = "" if self.int8_gemm_ops is None else f", int8 {self.int8_gemm_ops / 1e9:.1f} Gop/s (torch._int_mm)"
        return (f"roofline: peak GEMM {self.gemm_flops / 1e9:.1f} GFLOP/s ({self.dtype}, torch.matmul){int8}, "
                f"memory read bandwidth {self.read_bytes_per_s / 1e9:.1f} GB/s (torch.sum)")


def _best_seconds(fn, repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` calls, each waited for on a GPU (its work is queued, not done, when fn returns)."""
    done = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: thread pool start-up, page faults, cuBLAS handles
    done()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        done()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_gemm_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 3, device: str = "cpu") -> float:
    device = torch.device(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.matmul(a, b), repeats, device)


def measure_int8_gemm_ops(n: int = 2048, repeats: int = 3, device: str = "cpu") -> float | None:
    device = torch.device(device)
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    try:
        return 2 * n**3 / _best_seconds(lambda: torch._int_mm(a, b), repeats, device)
    except (RuntimeError, AttributeError):  # no int8 matmul in this torch build / on this device
        return None


def measure_read_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5, device: str = "cpu") -> float:
    device = torch.device(device)
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # written once: every page resident
    return num_bytes / _best_seconds(lambda: data.sum(), repeats, device)


def measure_roofline(dtype: torch.dtype, quick: bool = False, device: str = "cpu") -> Roofline:
    """The roofline of `device`; `quick` uses small sizes (tests): the figures are then only an order of magnitude.
    A GPU's sizes are larger, so a launch does not hide its peak."""
    on_gpu = torch.device(device).type != "cpu"
    n = 256 if quick else 8192 if on_gpu else 2048
    num_bytes = (8 << 20) if quick else (4 << 30) if on_gpu else (512 << 20)
    return Roofline(measure_gemm_flops(dtype, n=n, device=device),
                    measure_read_bandwidth(num_bytes=num_bytes, device=device), str(dtype).removeprefix("torch."),
                    measure_int8_gemm_ops(n=n, device=device))


@dataclass(frozen=True)
class WeightCounts:
    matmul_params: int  # every token: all linear layers (embedding lookup excluded)
    lm_head_params: int  # only tokens whose logits are computed
    bytes_read_per_step: int  # weights a step reads once, whatever its batch: linears + LM head + norms

    @classmethod
    def of(cls, model: nn.Module) -> "WeightCounts":
        from pagellm.layers.gguf_linear import GGUFLinear
        from pagellm.layers.gguf_planes import GGUFPlanesLinear
        from pagellm.layers.quantized import QuantizedEmbedding, QuantizedLinear
        from pagellm.loader.quantization import weight_bytes

        def params(module: nn.Module) -> int:  # a dense or quantized linear / embedding
            if isinstance(module, (nn.Linear, nn.Embedding)):
                return module.weight.numel()
            if isinstance(module, QuantizedEmbedding):
                return module.num_embeddings * module.embedding_dim
            return module.out_features * module.in_features

        embed = model.model.embed_tokens
        tied = getattr(model, "tie_word_embeddings", False)
        head = embed if tied else model.lm_head
        head_tables = {id(head), id(getattr(head, "table", None))}
        linears = [m for m in model.modules()
                   if isinstance(m, (nn.Linear, QuantizedLinear, GGUFLinear, GGUFPlanesLinear))
                   and id(m) not in head_tables]
        read = weight_bytes(model)  # resident bytes, quantized or not, tied storage once
        if not tied:
            read -= weight_bytes(embed)  # the lookup reads a few rows, not the table
        return cls(sum(params(m) for m in linears), params(head), read)

    def decode_flops(self, tokens: int) -> float:
        return 2.0 * (self.matmul_params + self.lm_head_params) * tokens

    def prefill_flops(self, tokens: int, sequences: int) -> float:
        return 2.0 * self.matmul_params * tokens + 2.0 * self.lm_head_params * sequences


def runs_int8_activations(model: nn.Module) -> bool:
    """Whether the model's quantized layers take int8 activations (their GEMM peak is then the int8 one)."""
    return any(getattr(m, "int8_activations", False) for m in model.modules())


def percent_of_roofline(roof: Roofline, flops: float, bytes_read: float, seconds: float,
                        int8: bool = False) -> tuple[float, str]:
    """(percent of the bound reached, which bound applies: 'bandwidth', 'GEMM' or 'int8 GEMM'). `int8`: the
    matmuls run int8 activations, so the GEMM bound is the int8 peak where one was measured."""
    int8 = int8 and roof.int8_gemm_ops is not None
    t_bw, t_gemm = bytes_read / roof.read_bytes_per_s, flops / (roof.int8_gemm_ops if int8 else roof.gemm_flops)
    bound, name = (t_bw, "bandwidth") if t_bw >= t_gemm else (t_gemm, "int8 GEMM" if int8 else "GEMM")
    return 100.0 * bound / seconds, name
