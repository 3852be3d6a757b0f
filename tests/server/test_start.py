"""The serve start's overlap: torch's native libraries load on a thread while torch-free modules import.

Each case runs in a fresh interpreter: this one has imported torch already, and the overlap exists only before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _fresh(script: str) -> dict:
    """The last line `script` prints, as JSON, from a fresh interpreter without the variables that turn the thread
    off."""
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "TORCH_USE_RTLD_GLOBAL")}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         cwd=ROOT, env=environ, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_modules_imported_beside_the_thread_are_torch_free_pure_python():
    """An extension module or torch among them would wait on the loader's lock for the thread's whole load,
    and the start would gain nothing without failing: so the lists are held here."""
    result = _fresh("""
        import importlib, json, sys
        from pagellm.server.start import NATIVE_FIRST, TORCH_FREE_MODULES
        for name in NATIVE_FIRST:
            importlib.import_module(name)
        before = set(sys.modules)
        for name in TORCH_FREE_MODULES:
            importlib.import_module(name)
        native = sorted(m for m in set(sys.modules) - before
                        if str(getattr(sys.modules[m], "__file__", "") or "").endswith((".so", ".pyd")))
        print(json.dumps({"torch": "torch" in sys.modules, "native": native}))
    """)
    assert result == {"torch": False, "native": []}


def test_the_thread_loads_libtorch_and_torch_then_imports_and_computes():
    result = _fresh("""
        import json, sys
        from pagellm.server.start import load_torch_libraries_in_background
        thread = load_torch_libraries_in_background()
        thread.join()
        maps = open("/proc/self/maps").read()
        loaded = "libtorch_cpu.so" in maps and "torch" not in sys.modules
        import torch
        print(json.dumps({"loaded": loaded, "sum": torch.arange(4.0).sum().item()}))
    """)
    assert result == {"loaded": True, "sum": 6.0}


def test_no_thread_where_the_environment_changes_which_libraries_load():
    """LD_LIBRARY_PATH's CUDA copies are what torch's own import orders its loads around; TORCH_USE_RTLD_GLOBAL
    loads libtorch another way. Both leave the loading to torch's import, as does a torch imported already."""
    result = _fresh("""
        import json, os
        from pagellm.server.start import torch_library_paths
        found = {"plain": torch_library_paths() is not None}
        for name, value in (("LD_LIBRARY_PATH", "/nonexistent"), ("TORCH_USE_RTLD_GLOBAL", "1")):
            os.environ[name] = value
            found[name] = torch_library_paths() is not None
            del os.environ[name]
        import torch
        found["after torch"] = torch_library_paths() is not None
        print(json.dumps(found))
    """)
    assert result == {"plain": True, "LD_LIBRARY_PATH": False, "TORCH_USE_RTLD_GLOBAL": False, "after torch": False}
