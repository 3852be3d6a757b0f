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


def pytest_configure(config):
    """Converted tokenizers are kept in a cache of this run's own (loader/tokenizer_cache.py): every engine of the
    suite shares it, and nothing is read from or left in the user's ~/.cache."""
    import os
    import tempfile

    config._pagellm_cache = tempfile.TemporaryDirectory(prefix="pagellm-test-cache-")
    os.environ["PAGELLM_CACHE_DIR"] = config._pagellm_cache.name


def pytest_unconfigure(config):
    cache = getattr(config, "_pagellm_cache", None)
    if cache is not None:
        cache.cleanup()
