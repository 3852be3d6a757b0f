"""Tests of the native kernels, each at every level this CPU executes (conftest.py)."""

import pytest

from pagellm.kernels import native

# The one honest reason to skip a kernel test: no C++ compiler at all, where the engine runs the torch reference
# ops and says so. A kernel that fails to build where a compiler exists raises KernelBuildError and fails here.
requires_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C++ compiler (set CXX or install g++): nothing native to test here")

# Every native kernel as start-up and LLM.stats() name it (kernels/selection.py), written out here so a kernel
# that silently stops being built, or one added without a test, changes what the level tests expect.
EVERY_KERNEL = ("GGUF blocks x int8 matmul", "int4 x int8 matmul", "int4 weight layout", "int4/int8 x bf16 matmul",
                "paged attention", "fused layer ops", "logits epilogue", "Gated DeltaNet decode", "RMS norm",
                "rotary embedding")
AVX512_ONLY = frozenset({"int4/int8 x bf16 matmul"})  # AVX-512 BF16 dot products; torch's matmul below


def kernels_at(level: str) -> dict[str, str]:
    """{kernel: where it runs} at `level` on a host with a compiler."""
    return {kernel: "torch" if kernel in AVX512_ONLY and level != "avx512" else level for kernel in EVERY_KERNEL}


def description_at(level: str) -> str:
    """The kernels line start-up logs and LLM.stats()["kernels"] holds at `level`: the level (and the host's
    extensions of it), every kernel that runs at it, then those that run in torch (all of them, without a
    compiler)."""
    where = kernels_at(level)
    extended = "".join(f" + {e}" for e in native.host_extensions(level, ("avx_vnni",)))
    if native.compiler() is None:
        return f"{level}{extended}: no C++ compiler (set CXX or install g++), torch reference ops for " + ", ".join(
            EVERY_KERNEL)
    compiled = ", ".join(kernel for kernel, at in where.items() if at == level)
    in_torch = ", ".join(kernel for kernel, at in where.items() if at == "torch")
    return f"{level}{extended} ({compiled})" + (f"; torch reference ops: {in_torch} (not at {level})" if in_torch else "")
