"""The kernels' error that callers outside the model side act on, kept free of torch so the CLI can name it
before torch loads."""

from __future__ import annotations


class KernelBuildError(RuntimeError):
    """A native kernel did not build (or load) at a level it is promised at; the message names the kernel and the
    level, then gives the compiler's own words (kernels/build/native.py)."""
