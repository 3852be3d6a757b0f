"""The start of `pagellm serve`: torch's native libraries load on one core while the server's torch-free
modules import on the other.

Why: a good part of `import torch` (with PyPI's CUDA wheel) is the dynamic loader mapping and relocating libtorch
and the CUDA libraries the wheel links, and running their static constructors. CPython holds the GIL through an
extension module's dlopen, so the process does nothing else meanwhile. Called through ctypes, dlopen releases the
GIL: a thread loads the same files torch's import would, in the order torch's import would (its global
dependencies first, then torch._C's tree), while the main thread imports FastAPI, uvicorn and the server modules
that need no torch. torch's own import then finds those files loaded. No module imported here may import torch: it
would wait for the loader's lock (a test holds the list torch-free).
measured: docs/benchmarks/2026-11-26-start-up-and-memory.md
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from pathlib import Path

# imported before the loading thread starts: every extension module the list below loads (its own dlopen would
# wait out the thread's on the loader's lock), and pydantic, whose Rust code registers a thread-local destructor
# on its first call in a thread (glibc takes the same lock to do that)
NATIVE_FIRST = ("pydantic.types", "ssl", "asyncio", "subprocess", "_multiprocessing", "pickle", "queue", "csv",
                "heapq", "array", "select", "fcntl", "zlib", "bz2", "lzma", "mmap", "resource", "markupsafe")
# imported beside the loading thread: pure Python once NATIVE_FIRST is in, and torch-free (tests/server/test_start.py)
TORCH_FREE_MODULES = (
    "fastapi", "fastapi.responses", "starlette.middleware.cors", "uvicorn", "uvicorn.config", "uvicorn.server",
    "uvicorn.lifespan.on", "uvicorn.protocols.http.h11_impl", "uvicorn.loops.asyncio", "jinja2",
    "prometheus_client", "pagellm.server.protocol", "pagellm.server.converted_requests", "pagellm.server.metrics",
    "pagellm.server.errors", "pagellm.server.error_answers", "pagellm.server.guards", "pagellm.server.infill",
    "pagellm.server.reasoning", "pagellm.server.responses", "pagellm.loader.model_configs", "pagellm.core.types",
    "pagellm.loader.chat_template", "pagellm.outputs",
    "pydantic.v1",  # FastAPI's route building asks whether each model is a pydantic v1 one: it imports this
)


def import_server():
    """Import the server with torch's native libraries loading beside it; returns `run_server`."""
    for name in NATIVE_FIRST:
        importlib.import_module(name)
    loading = load_torch_libraries_in_background()
    for name in TORCH_FREE_MODULES:
        importlib.import_module(name)
    from pagellm.server.run import run_server  # torch: its dlopen calls wait for the thread's, then find it all

    if loading is not None:
        loading.join()
    return run_server


def torch_library_paths() -> tuple[Path, Path] | None:
    """(torch's global-dependency library, torch._C's extension module) as torch's import finds them, or None
    where that import is not the one this module knows: not Linux, torch imported already, no such files, or an
    environment that changes which CUDA libraries load (LD_LIBRARY_PATH, whose copies torch's import works around
    by loading the wheels' first, in an order this thread would not keep; TORCH_USE_RTLD_GLOBAL)."""
    if sys.platform != "linux" or "torch" in sys.modules:
        return None
    if os.environ.get("LD_LIBRARY_PATH") or os.environ.get("TORCH_USE_RTLD_GLOBAL"):
        return None
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(spec.submodule_search_locations[0])
    global_deps = package / "lib" / "libtorch_global_deps.so"
    extension = next((package / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
                      if (package / f"_C{suffix}").is_file()), None)
    if not global_deps.is_file() or extension is None:
        return None
    return global_deps, extension


def load_torch_libraries_in_background() -> threading.Thread | None:
    """Start a daemon thread that dlopens torch's native libraries (a no-op for torch's import after it); None
    where torch_library_paths gives none. A failure on the thread leaves the loading to torch's import."""
    paths = torch_library_paths()
    if paths is None:
        return None
    thread = threading.Thread(target=_dlopen_in_order, args=paths, name="pagellm-torch-libraries", daemon=True)
    thread.start()
    return thread


def _dlopen_in_order(global_deps: Path, extension: Path) -> None:
    try:
        dlopen = ctypes.CDLL(None).dlopen  # a foreign call: ctypes releases the GIL for its length
    except (OSError, AttributeError):  # no C library to ask: torch's import loads everything itself
        return
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    # as torch/__init__.py loads them: global dependencies into the global scope, then the extension with the
    # interpreter's own flags; the handles stay open, as torch's own do
    if dlopen(os.fsencode(global_deps), os.RTLD_GLOBAL | os.RTLD_NOW):
        dlopen(os.fsencode(extension), sys.getdlopenflags())
