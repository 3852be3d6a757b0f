"""An engine's native kernels, chosen once from its config (KernelConfig), checked, and described.

Every kernel the chosen level promises is built (or loaded from the cache) at selection: one that does not
build is a KernelBuildError with the compiler's message, so start-up stops rather than running a torch fallback
the user did not ask for. Only a machine with no C++ compiler runs the torch reference ops with native kernels
on; that is logged once, naming every kernel it affects."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagellm.config import KernelConfig
from pagellm.kernels.build.errors import KernelBuildError
from pagellm.kernels.cpu import (attention, bf16_gemv, elementwise, f32_rows, gated_delta_decode, gguf_blocks,
                                 gguf_layout, layer_ops, logits, quant_gemv, token_sampling)
from pagellm.kernels.build import native

logger = logging.getLogger("pagellm.kernels")

# Every native kernel, in the order start-up names them.
LIBRARIES: tuple[native.Library, ...] = (
    *gguf_blocks.LIBRARIES, *quant_gemv.LIBRARIES, *attention.LIBRARIES, *layer_ops.LIBRARIES, *logits.LIBRARIES,
    *gated_delta_decode.LIBRARIES, *elementwise.LIBRARIES, *token_sampling.LIBRARIES, *bf16_gemv.LIBRARIES,
    *f32_rows.LIBRARIES, *gguf_layout.LIBRARIES)


@dataclass(frozen=True)
class Kernels:
    """The CPU kernels an engine runs: `level` (None: torch's reference ops, or a model on another device),
    which its runner's plan binds the model to, and `description`, the line start-up logs and LLM.stats()
    shows."""
    level: str | None
    description: str


def select_kernels(config: KernelConfig, device: str = "cpu") -> Kernels:
    """The config's level (a ValueError naming cpu_isa if this CPU cannot run it), each kernel it promises
    built (a KernelBuildError if one fails), logged, e.g. "avx2 (GGUF blocks x int8 matmul, ...); torch
    reference ops: int4/int8 x bf16 matmul (not at avx2)". A model on another device runs none of these CPU
    kernels: nothing is built for it, and a broken compiler on its host does not stop it."""
    kind = torch.device(device).type
    try:
        level = native.level_of(config) if kind == "cpu" else None
    except ValueError as e:
        raise ValueError(f"cpu_isa: {e}") from None
    try:
        description = describe(level) if kind == "cpu" else f"CPU kernels not used on {kind} (see the backend line)"
    except KernelBuildError as e:
        raise KernelBuildError(f"{e}\n(to run without it: a lower --cpu-isa, or --no-native-kernels for torch's "
                               "reference ops)") from None
    if level is not None and native.compiler() is None:
        logger.warning("kernels: %s", description)  # the one place the fallback is said
    else:
        logger.info("kernels: %s", description)
    return Kernels(level, description)


def kernel_levels(at: str | None) -> dict[str, str]:
    """{kernel: the level it runs at, or "torch"} at level `at` (None, native kernels off: every kernel
    "torch"), each promised kernel built now if not yet cached. A kernel that fails to build raises
    KernelBuildError."""
    if at is not None:
        native.prebuild(library.build_of(at) for library in LIBRARIES if library.promised(at))
    return {library.title: at if library.at(at) is not None else "torch" for library in LIBRARIES}


def release_thread_scratch() -> None:
    """Every kernel library loaded so far gives back the scratch its threads keep between calls (an idle engine,
    csrc/thread_scratch.h)."""
    for library in LIBRARIES:
        library.release_scratch()


def compute_dtype(dtype: str | None, device: str, level: str | None, gguf_blocks: bool = False) -> str:
    """The compute dtype `dtype` names; None or "auto": on CUDA bfloat16 (float16 on a GPU without it); on a CPU
    bfloat16 where the kernels' `level` has a native bf16 dot product (avx512: AVX-512 BF16), float32 elsewhere,
    and float32 at every level for a GGUF run as stored (`gguf_blocks`).
    Why not bf16 on every CPU: without AVX-512 BF16, torch and our kernels emulate bf16 arithmetic, slower
    than fp32 (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md). Why fp32 for a GGUF's
    blocks: their matmuls take int8 activations whatever the dtype, so bf16 buys only bandwidth, and it cost
    small models up to 1.7x llama.cpp's KL (its weights outside the blocks, norms and biases, rounded to bf16
    the largest part; docs/benchmarks/2026-11-26-bf16-accuracy.md), and with the MLP in one kernel its fp32
    intermediate is the faster one (docs/benchmarks/2026-11-27-fused-mlp.md)."""
    if dtype not in (None, "auto"):
        return dtype
    kind = torch.device(device).type
    if kind == "cuda":  # as vLLM: bf16 where the GPU computes it (Ampere and later), else fp16
        # not emulated bf16 (pre-Ampere GPUs report it supported by default): those get fp16
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    return "bfloat16" if kind == "cpu" and level == "avx512" and not gguf_blocks else "float32"


def narrow_dtype(dtype: str | None, device: str, level: str | None, gguf_blocks: bool = False,
                 kv_cache: str = "auto") -> str | None:
    """The dtype attention runs in (queries, scores, output) where narrower than the activations: bfloat16 where
    `dtype` auto chose float32 for a GGUF's blocks on a CPU whose level computes bf16 natively (avx512) and the
    K/V cache is bf16 (`--kv-cache-dtype bfloat16`: vdpbf16ps reads it); None elsewhere. The default fp16 K/V
    keep attention in fp32, and the MLP runs in the activations' dtype at every level: gate/up, the activation
    and down are one kernel (csrc/quant_gguf.cpp), faster in fp32 than the bf16 intermediate it replaced
    (docs/benchmarks/2026-11-27-fused-mlp.md)."""
    auto_fp32 = dtype in (None, "auto") and compute_dtype(dtype, device, level, gguf_blocks) == "float32"
    native_bf16 = torch.device(device).type == "cpu" and level == "avx512"
    bf16_cache = kv_cache_dtype(kv_cache, dtype, device, level, gguf_blocks) == "bfloat16"
    return "bfloat16" if auto_fp32 and native_bf16 and gguf_blocks and bf16_cache else None


def kv_cache_dtype(kv_cache_dtype: str, dtype: str | None, device: str, level: str | None,
                   gguf_blocks: bool = False) -> str:
    """The dtype K/V are stored in: `kv_cache_dtype` when named; for "auto" the compute dtype, except a 16-bit
    type when `dtype` is auto and chose float32 on a CPU with native kernels: float16 for a GGUF's blocks
    (llama.cpp's default cache type: its 10-bit mantissa put the tiny GGUFs' KL at fp32 K/V's, where bf16 K/V
    and the bf16 attention they allow at avx512 cost 3-6%), bfloat16 for an HF checkpoint's K/V (fp16's range is
    not known to hold them). `--kv-cache-dtype bfloat16` gives avx512 its bf16 attention back (~10% faster
    prefill at a 2048-token prompt). Why 16 bits: a decode step streams the whole context's K/V, so their bytes
    set attention's time on a bandwidth-bound host, and the kernels read either type under fp32 queries exactly
    (converted on load). An explicit float32 keeps fp32 K/V: the mode tests compare with HF in. Measured:
    docs/benchmarks/2026-11-24-avx2-level-against-llama-cpp.md, docs/benchmarks/2026-11-26-bf16-accuracy.md"""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    compute = compute_dtype(dtype, device, level, gguf_blocks)
    on_cpu = torch.device(device).type == "cpu"
    narrow = dtype in (None, "auto") and on_cpu and compute == "float32" and level is not None
    if not narrow:
        return compute  # (the torch reference would only widen a 16-bit cache every step)
    return "float16" if gguf_blocks else "bfloat16"


def narrow_sites(narrow: torch.dtype | str | None) -> str:
    """", bfloat16 attention" where attention runs narrower than the activations, "": for start-up lines and
    reports."""
    return "" if narrow is None else f", {str(narrow).removeprefix('torch.')} attention"


def describe(level: str | None) -> str:
    """`level` and every kernel: those that run at it, and those that run in torch and why."""
    if level is None:
        return "off (torch reference ops)"
    levels = kernel_levels(level)
    compiled = [kernel for kernel, at in levels.items() if at != "torch"]
    in_torch = ", ".join(kernel for kernel, at in levels.items() if at == "torch")
    extended = "".join(f" + {e}" for e in native.host_extensions(level, quant_gemv.Q8_EXTENSIONS))
    if not compiled:
        return f"{level}{extended}: no C++ compiler (set CXX or install g++), torch reference ops for {in_torch}"
    return f"{level}{extended} ({', '.join(compiled)})" + (
        f"; torch reference ops: {in_torch} (not at {level})" if in_torch else "")
