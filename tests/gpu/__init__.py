"""GPU code tested on a CPU: Triton kernels under Triton's interpreter where there is no CUDA device."""

from __future__ import annotations

import contextlib
import inspect
import os

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"  # where these tests put tensors: a GPU's, else the interpreter's CPU


@contextlib.contextmanager
def interpreter(wanted: bool):
    """TRITON_INTERPRET=1 within the block when `wanted` (no CUDA device), as before after it. Triton reads it
    when a kernel is decorated (`triton.jit`, at import: its own tl.max, tl.sum... when triton is first imported)
    and at each launch; outside the block the processes other tests start inherit nothing."""
    previous = os.environ.get("TRITON_INTERPRET")
    if wanted:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def under_interpreter(make):
    """make(), under the interpreter without a GPU: Triton kernel modules imported for the first time inside
    are decorated for it (`triton.jit` reads TRITON_INTERPRET then)."""
    with interpreter(not ON_GPU):
        return make()


def list_language_members_once() -> None:
    """Triton's interpreter patches its language functions before every launch and restores them after, finding
    them each time with inspect.getmembers over its modules, a large part of an interpreted launch of our kernels
    (docs/benchmarks/2026-11-29-xeon-amx-host.md). The members found do not change between launches, so they are listed once per module and
    the same ones patched. Left as it is where the interpreter has another shape (another Triton version)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as triton_interpreter
    except ImportError:
        return
    patch_builtin, patch_attr = (getattr(triton_interpreter, name, None) for name in ("_patch_builtin", "_patch_attr"))
    if patch_builtin is None or patch_attr is None or not hasattr(tl.core, "is_builtin") \
            or list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return
    listed: dict = {}

    def patch_listed(pkg, builder, scope):
        if pkg not in listed:  # listed unpatched: each launch's patches are restored before the next
            listed[pkg] = [(name, member) for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name, member in listed[pkg]:
            patch_attr(pkg, name, member, builder, scope)

    triton_interpreter._patch_builtin = patch_listed
