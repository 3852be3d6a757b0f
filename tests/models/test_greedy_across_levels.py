"""Greedy tokens do not depend on the CPU: the same engine at every instruction-set level this host executes
(kernels/native.py) gives the same ids, dense and int4 (int8 activations), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import write_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.kernels import native


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_ids_identical_at_every_level(tmp_path, family, quantization, dtype):
    write_tiny_checkpoint(family, tmp_path)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 30)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    previous = native.level()
    ids = {}
    try:
        for level in native.host_levels():
            llm = LLM(model=str(tmp_path), dtype=dtype, quantization=quantization, cpu_isa=level,
                      skip_tokenizer_init=True, kv_cache_memory=0.01)
            assert llm.stats()["kernels"].startswith(level)
            ids[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.shutdown()
    finally:
        native.select(previous or "auto", previous is not None)
    for level, got in ids.items():
        assert got == ids[native.host_levels()[0]], level
