"""GPU code tested on a CPU: Triton kernels under Triton's interpreter where there is no CUDA device."""

from __future__ import annotations

import contextlib
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
