"""Step reuse: decode inputs prepared by diff give the same tokens as inputs rebuilt every step."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")  # sliding window 8, mixed layer types
    write_tiny_checkpoint("gemma3", path)
    return path


def _llm(path, step_reuse: bool) -> LLM:
    llm = LLM(model=str(path), block_size=4, kv_cache_memory=0.01, skip_tokenizer_init=True)
    if not step_reuse:
        llm.engine.runner.decode_inputs = None
    return llm


def _generate(llm: LLM, prompts, max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_ids_identical_with_step_reuse_on_and_off(gemma_dir):
    # Prompts of different lengths and staggered ends: the batch layout changes as requests
    # finish, blocks (size 4) are appended mid-decode, and the window slides.
    prompts = [[(7 * i + 3 * j) % 250 + 2 for j in range(5 + 3 * i)] for i in range(6)]
    max_tokens = [30, 9, 22, 30, 4, 17]
    on, off = _llm(gemma_dir, True), _llm(gemma_dir, False)
    assert _generate(on, prompts, max_tokens) == _generate(off, prompts, max_tokens)
    stats = on.stats()
    assert stats["step_reuse_hits"] > 0 and stats["step_reuse_misses"] > 0  # both paths ran
    assert off.stats()["step_reuse_hits"] == 0


def test_steady_batched_decode_reuses_nearly_every_step(gemma_dir):
    llm = _llm(gemma_dir, True)
    prompts = [[(5 * i + j) % 250 + 2 for j in range(12)] for i in range(8)]
    _generate(llm, prompts, [40] * 8)
    stats = llm.stats()
    # One rebuild after the prefill, then every decode step is prepared by diff.
    assert stats["step_reuse_misses"] == 1
    assert stats["step_reuse_rate"] >= 0.95
