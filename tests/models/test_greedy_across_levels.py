"""Greedy tokens do not depend on the CPU: the same engine at every instruction-set level this host executes
(kernels/build/native.py) gives the same ids, dense, int4 (int8 activations) and GGUF blocks, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels.build import native
from pagellm.kernels import selection
from tests.kernels import kernels_at
from tests.loader.gguf_builders import T, write_tiny_gguf
from tests.models.tiny_checkpoints import write_tiny_checkpoint


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_ids_identical_at_every_level(tmp_path, family, quantization, dtype):
    write_tiny_checkpoint(family, tmp_path)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 30)]
    assert_same_ids_at_every_level(str(tmp_path), dtype, quantization, prompts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_ids_identical_at_every_level_on_gguf_blocks(tmp_path, dtype):
    types = {**{f"blk.{i}.{name}.weight": kind for i in range(2) for name, kind in (
        ("attn_q", T.Q4_1), ("attn_k", T.Q5_1), ("attn_v", T.Q8_0), ("attn_output", T.Q4_0), ("ffn_gate", T.Q5_0),
        ("ffn_up", T.Q5_0))}, "blk.0.ffn_down.weight": T.Q4_K, "blk.1.ffn_down.weight": T.Q6_K,
        "token_embd.weight": T.Q8_0}
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", types=types)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 30)]
    assert_same_ids_at_every_level(str(tiny.path), dtype, "auto", prompts)


def assert_same_ids_at_every_level(model: str, dtype: str, quantization: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = {}
    for level in native.host_levels():
        llm = LLM(model=model, dtype=dtype, quantization=quantization, cpu_isa=level,
                  skip_tokenizer_init=True, kv_cache_memory=0.01)
        assert selection.kernel_levels(level) == kernels_at(level)  # every kernel built at this level
        assert llm.stats()["kernels"] == selection.describe(level)
        assert llm.engine.runner.kernel_level == level
        ids[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    for level, got in ids.items():
        assert got == ids[native.host_levels()[0]], level
