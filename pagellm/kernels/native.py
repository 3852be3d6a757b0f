"""Build-on-first-use loader for the C++ CPU kernels in `pagellm/kernels/csrc/`.

Each `csrc/<name>.cpp` is a plain C++ file exporting `extern "C"` functions; it is
compiled once into its own shared library and called through ctypes with
tensor data pointers. Why not torch.utils.cpp_extension: it needs ninja and the
torch headers, and takes ~1 minute per build on 2 cores; a header-free file
builds in a few seconds, and ctypes releases the GIL around each call.

The library is cached under ~/.cache/pagellm/kernels (or $PAGELLM_KERNEL_CACHE),
keyed by the source, the compiler flags, the compiler and the CPU's flags
(it is built with -march=native). With no compiler, or a failed build, `load`
returns None after one warning naming the cause, and callers use the torch
reference path.

OpenMP: the library links libgomp.so.1; torch's wheel already loaded its own
copy under that soname, so the dynamic linker reuses it and both share one
thread pool (two pools spinning on 2 cores would halve throughput).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch  # noqa: F401  -- imported first so torch's libgomp is the one our libraries bind to

CSRC = Path(__file__).with_name("csrc")
DTYPE_CODES = MappingProxyType({torch.float32: 0, torch.bfloat16: 1})  # the kernels' dtype argument (is_bf16)
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")


def cache_dir() -> Path:
    root = os.environ.get("PAGELLM_KERNEL_CACHE") or Path.home() / ".cache" / "pagellm" / "kernels"
    return Path(root)


def native_disabled() -> bool:
    """PAGELLM_NATIVE=0 forces the torch reference paths (for comparisons and debugging)."""
    return os.environ.get("PAGELLM_NATIVE", "1") == "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build(name: str, source: Path, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # shared includes (bf16.h)
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, " ".join(CXX_FLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run([compiler, *CXX_FLAGS, str(source), "-o", str(out)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{result.stderr[-2000:]}")
        os.replace(out, target)
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `csrc/<name>.cpp`, or None (with one warning) when it cannot be built here."""
    if native_disabled():
        return None
    source = CSRC / f"{name}.cpp"
    compiler = _compiler()
    if compiler is None:
        warnings.warn(f"pagellm: no C++ compiler found (set CXX or install g++); native kernel {name!r} "
                      "unavailable, using the slower torch reference path", RuntimeWarning, stacklevel=2)
        return None
    try:
        return ctypes.CDLL(str(_build(name, source, compiler)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"pagellm: native kernel {name!r} unavailable, using the torch reference path: {e}",
                      RuntimeWarning, stacklevel=2)
        return None


def bind(name: str, signatures: Mapping[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """`load(name)` with each function of `signatures` ({symbol: (argtypes, restype)}) typed for ctypes."""
    lib = load(name)
    if lib is not None:
        for symbol, (argtypes, restype) in signatures.items():
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    """Data pointer of a tensor for a ctypes call (None -> NULL)."""
    return ctypes.c_void_p(0 if tensor is None else tensor.data_ptr())
