"""Suite-wide set-up that has to happen before any test module or other conftest.py is imported, and the
expensive objects that tests in several directories share."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import interpreter, list_language_members_once

# Triton decorates its own language functions (tl.zeros, tl.max...) when it is first imported, under the
# TRITON_INTERPRET of that moment, and other conftests and test modules import it indirectly (transformers,
# torch._dynamo). Without CUDA, import it here first, at module level (pytest_configure would come after the
# other initial conftests), under the interpreter, so tests/gpu can run its kernels on the CPU.
with interpreter(not torch.cuda.is_available()):
    try:
        import triton  # noqa: F401
    except ImportError:  # e.g. PyTorch's CPU-only wheel, which does not bring triton: tests/gpu says so
        pass
    else:
        list_language_members_once()


def pytest_configure(config):
    """Converted tokenizers are kept in a cache of this run's own (loader/tokenizer_cache.py): every engine of the
    suite shares it, and nothing is read from or left in the user's ~/.cache. tests/lower_levels.py gives its
    passes one such cache of its own (PAGELLM_TEST_CACHE_DIR), which it removes."""
    import os
    import tempfile

    shared = os.environ.get("PAGELLM_TEST_CACHE_DIR")
    if shared:
        os.environ["PAGELLM_CACHE_DIR"] = shared
        return
    config._pagellm_cache = tempfile.TemporaryDirectory(prefix="pagellm-test-cache-")
    os.environ["PAGELLM_CACHE_DIR"] = config._pagellm_cache.name


def pytest_unconfigure(config):
    cache = getattr(config, "_pagellm_cache", None)
    if cache is not None:
        cache.cleanup()


# ---- expensive objects shared across test directories (one per session) ---------------------------------------


@pytest.fixture(scope="session")
def embedded_llm():
    """LLM() of the embedded model with a KV pool that holds one max_model_len sequence: the engine of
    tests/test_llm.py and tests/test_structured_output.py alike, built once (~2 s a build). Their tests leave no
    request behind and read its counters as differences or at rest, and no two share a prompt of a full KV block
    (what its prefix cache would keep), so neither module sees the other's use."""
    from pagellm import LLM

    return LLM(kv_cache_memory=0.25, max_model_len=4096)


@pytest.fixture(scope="session")
def hf_gemma3_of_the_embedded_model():
    """transformers' Gemma3ForCausalLM in the embedded GGUF's shape (fp32, eager attention), for the tests that
    compare with HF (tests/test_llm.py, tests/loader/test_default_model.py). Each loads the weights it checks into
    it, every parameter (each asserts only the tied lm_head is missing), and re-ties the head. Built once, and
    without drawing random weights that the loads overwrite anyway: drawing them cost ~4 s a build. Its buffers
    (RoPE frequencies, the embedding scale) are computed in the modules' constructors, which still run."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from pagellm.bench.peers import transformers_config
    from pagellm.loader.default_model import default_model_path
    from pagellm.loader.gguf import load_gguf_config

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: the random weights are drawn, and overwritten all the same
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(transformers_config(load_gguf_config(default_model_path())),
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()  # no dropout in Gemma 3 either way: eval only makes that independent of the tests' order


@pytest.fixture(scope="session")
def tiny_qwen3_with_the_embedded_tokenizer(tmp_path_factory):
    """write_tiny_checkpoint_with_tokenizer's tiny Qwen3 with the Hermes tools template, written once (~5 s: the
    262k-id tokenizer is loaded and saved) for tests/server/test_tool_api.py, which needs the template, and
    tests/distributed/test_tensor_parallel.py, which generates from plain prompts (the template is unused there).
    Its users only read the directory."""
    from pathlib import Path

    from tests.models.tiny_checkpoints import write_tiny_checkpoint_with_tokenizer

    template = (Path(__file__).parent / "server" / "templates" / "hermes_tools.jinja").read_text()
    return write_tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("tiny-qwen3-tokenizer"), template)
