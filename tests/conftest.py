"""Suite-wide set-up that has to happen before any test module or other conftest.py is imported."""

from __future__ import annotations

import torch

from tests.gpu import interpreter

# Triton decorates its own language functions (tl.zeros, tl.max...) when it is first imported, under the
# TRITON_INTERPRET of that moment, and other conftests and test modules import it indirectly (transformers,
# torch._dynamo). Without CUDA, import it here first, at module level (pytest_configure would come after the
# other initial conftests), under the interpreter, so tests/gpu can run its kernels on the CPU.
with interpreter(not torch.cuda.is_available()):
    try:
        import triton  # noqa: F401
    except ImportError:  # e.g. PyTorch's CPU-only wheel, which does not bring triton: tests/gpu says so
        pass
