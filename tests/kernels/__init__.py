"""Tests of the native kernels, each at every level this CPU executes (conftest.py)."""

import pytest

from pagellm.kernels.build import native

# The one honest reason to skip a kernel test: no C++ compiler at all, where the engine runs the torch reference
# ops and says so. A kernel that fails to build where a compiler exists raises KernelBuildError and fails here.
requires_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C++ compiler (set CXX or install g++): nothing native to test here")

# Every native kernel as start-up and LLM.stats() name it (kernels/selection.py), written out here so a kernel
# that silently stops being built, or one added without a test, changes what the level tests expect.
EVERY_KERNEL = ("GGUF blocks x int8 matmul", "int4 x int8 matmul", "int4 weight layout", "int4/int8 x bf16 matmul",
                "paged attention", "fused layer ops", "logits epilogue", "Gated DeltaNet decode", "RMS norm",
                "rotary embedding", "sampled-token draw", "bf16 x bf16 matmul of a few rows",
                "fp32 matmul of batch-independent rows", "GGUF block layout at load")
# AVX-512 BF16 dot products; torch's matmul below
AVX512_ONLY = frozenset({"int4/int8 x bf16 matmul", "bf16 x bf16 matmul of a few rows"})
NOT_GENERIC = frozenset({"sampled-token draw"})  # emulated fma there: torch's own is faster


def kernels_at(level: str) -> dict[str, str]:
    """{kernel: where it runs} at `level`: the level, or "torch" where the kernel does not exist at it or there is
    no compiler."""
    compiled = native.compiler() is not None
    return {kernel: level if compiled and (level == "avx512" or kernel not in AVX512_ONLY)
            and (level != "generic" or kernel not in NOT_GENERIC) else "torch" for kernel in EVERY_KERNEL}
