"""The process's native kernels, chosen once from the engine config (KernelConfig) and described in one line."""

from __future__ import annotations

import logging

from pagellm.config import KernelConfig
from pagellm.kernels import attention, gated_delta_native, gguf_blocks, layer_ops, logits, native, quant_gemv

logger = logging.getLogger("pagellm.kernels")


def select_kernels(config: KernelConfig) -> str:
    """Make the config's level the one every kernel wrapper loads (a ValueError naming cpu_isa if this CPU
    cannot run it); log and return what runs, e.g. "avx2 (int4 x int8 matmul, paged attention, ...)"."""
    try:
        native.select(config.cpu_isa, config.native_kernels)
    except ValueError as e:
        raise ValueError(f"cpu_isa: {e}") from None
    description = describe()
    logger.info("kernels: %s", description)
    return description


def compute_dtype(dtype: str | None, device: str) -> str:
    """The compute dtype `dtype` names; None or "auto": bfloat16 on a CPU whose selected level has a native bf16
    dot product (avx512: AVX-512 BF16), float32 elsewhere. Why not bf16 everywhere: without AVX-512 BF16, torch
    and our kernels emulate bf16 arithmetic, slower than fp32.
    measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md"""
    if dtype not in (None, "auto"):
        return dtype
    return "bfloat16" if device == "cpu" and native.level() == "avx512" else "float32"


def kv_cache_dtype(kv_cache_dtype: str, dtype: str | None, device: str) -> str:
    """The dtype K/V are stored in: `kv_cache_dtype` when named; for "auto" the compute dtype, except bfloat16
    when `dtype` is auto and chose float32 on a CPU with native kernels. Why: a decode step streams the whole
    context's K/V, so their bytes set attention's time on a bandwidth-bound host, and the kernels read bf16 K/V
    under fp32 queries exactly (converted on load). An explicit float32 keeps fp32 K/V: the mode tests compare with HF in.
    measured: docs/benchmarks/2026-11-24-avx2-level-against-llama-cpp.md"""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    compute = compute_dtype(dtype, device)
    narrow = dtype in (None, "auto") and device == "cpu" and compute == "float32" and native.level() is not None
    return "bfloat16" if narrow else compute  # (the torch reference would only widen a bf16 cache every step)


def describe() -> str:
    """The selected level and the native kernels that run at it (each built now if not yet cached)."""
    level = native.level()
    if level is None:
        return "off (torch reference ops)"
    present = [name for name, available in (
        ("GGUF blocks x int8 matmul", gguf_blocks.available()),
        ("int4 x int8 matmul", quant_gemv.q8_available()),
        ("int4/int8 x bf16 matmul", quant_gemv.available()),
        ("paged attention", attention._native_kernel() is not None),
        ("fused layer ops", layer_ops._lib() is not None),
        ("logits epilogue", logits._kernel("argmax_rows") is not None),
        ("Gated DeltaNet decode", gated_delta_native._kernel("rule") is not None),
    ) if available]
    extended = "".join(f" + {e}" for e in native.host_extensions(level, quant_gemv.Q8_EXTENSIONS))
    return f"{level}{extended} ({', '.join(present) or 'none could be built: torch reference ops'})"
