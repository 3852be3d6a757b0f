"""Prefix caching for hybrid models: recurrent-state snapshots at block boundaries, end to end.

Requests share a 37-token prefix and differ after it. The oracle is HF's greedy
`generate`; with the cache on, a follower must hit exactly at the last full
block boundary of the shared prefix (36 tokens with 4-token blocks, 32 with 8)
and still produce HF's ids, whatever the chunking of either request.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig, EngineConfig, ModelConfig
from pagellm.engine import LLMEngine
from pagellm.runner.model_runner import state_bytes_per_slot
from tests.models.tiny_checkpoints import write_hybrid_checkpoint

COMMON = 37
_GEN = torch.Generator().manual_seed(37)
PREFIX = torch.randint(3, 256, (COMMON,), generator=_GEN).tolist()
PROMPTS = [PREFIX + torch.randint(3, 256, (n,), generator=_GEN).tolist() for n in (5, 11, 2)]
# A block-aligned prompt (40 tokens) and one extending it: the first hits at 40 only if the
# boundary at its very end was snapshotted (its last token may be fed alone, via the decode path).
ALIGNED = [PROMPTS[0][:40], PROMPTS[0][:40] + [9, 8, 7]]
MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3-next", "qwen3.5-moe"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_hybrid_checkpoint(request.param, path)
    expected = []
    for prompt in PROMPTS + ALIGNED:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return path, expected  # PROMPTS' ids, then ALIGNED's


def _llm(path, block_size: int, **kwargs) -> LLM:
    """A snapshot at every block boundary (state_snapshot_interval: the block size; the default is sparser)."""
    return LLM(model=str(path), skip_tokenizer_init=True, block_size=block_size, state_snapshot_interval=block_size,
               **{"kv_cache_memory": 0.01, "dtype": "float32", **kwargs})  # compared with HF fp32


def _llm_with_snapshot_budget(path, block_size: int, gib: float) -> LLM:
    """LLM() has no state_snapshot_memory argument: build its engine from an EngineConfig."""
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(block_size=block_size, kv_cache_memory=0.01, state_snapshot_memory=gib,
                                            state_snapshot_interval=block_size))
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(config, skip_tokenizer_init=True)
    return llm


def _one_by_one(llm: LLM, prompts) -> list[list[int]]:
    """Each request admitted after the previous one finished."""
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _set_budget(llm: LLM, max_num_batched_tokens: int, n_ubatch: int) -> None:
    """Change the step token budget between requests (chunked prefill for some requests only)."""
    scheduler = llm.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=max_num_batched_tokens,
                                           n_ubatch=n_ubatch)


def _assert_nothing_held(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["state_snapshots_used"] == 0  # no pinned or pending snapshot row outlives its step


@pytest.mark.parametrize("block_size", [4, 8])
def test_sequential_hit_at_last_full_block_matches_hf_and_cache_off(checkpoint, block_size):
    path, expected = checkpoint
    llm = _llm(path, block_size)
    assert _one_by_one(llm, PROMPTS) == expected[:3]
    boundary = COMMON // block_size * block_size
    assert llm.stats()["prefix_cache_hit_tokens"] == 2 * boundary  # both followers resume at the boundary
    assert llm.stats()["state_snapshots_cached"] > 0
    _assert_nothing_held(llm)
    off = _llm(path, block_size, enable_prefix_caching=False)
    assert _one_by_one(off, PROMPTS) == expected[:3]
    assert off.stats()["prefix_cache_hit_tokens"] == 0 and off.stats()["state_snapshots_total"] == 0


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_concurrent_followers_wait_for_the_snapshot_then_hit(checkpoint, block_size, async_scheduling):
    """With steps launched ahead too: a snapshot becomes restorable once its step is read back."""
    path, expected = checkpoint
    llm = _llm(path, block_size, async_scheduling=async_scheduling)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [PARAMS] * len(PROMPTS), use_tqdm=False)]
    assert got == expected[:3]
    # The snapshot is written while the leader's step runs: followers admitted in that step would
    # restore garbage, so they wait one step and then hit.
    assert llm.stats()["prefix_cache_hit_tokens"] == 2 * (COMMON // block_size * block_size)
    assert (llm.stats()["steps_launched_ahead"] > 0) == async_scheduling
    _assert_nothing_held(llm)


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("chunked_first", [True, False], ids=["chunked-then-whole", "whole-then-chunked"])
def test_hit_does_not_depend_on_chunking(checkpoint, block_size, chunked_first):
    path, expected = checkpoint
    llm = _llm(path, block_size)
    small, whole = (10, 5), (2048, 64)  # 10-token chunks: no chunk edge falls on a block boundary
    _set_budget(llm, *(small if chunked_first else whole))
    first = _one_by_one(llm, PROMPTS[:1])
    _set_budget(llm, *(whole if chunked_first else small))
    second = _one_by_one(llm, PROMPTS[1:2])
    assert first + second == expected[:2]
    assert llm.stats()["prefix_cache_hit_tokens"] == COMMON // block_size * block_size
    _assert_nothing_held(llm)


@pytest.mark.parametrize("num_rows", [1, 2])
def test_tiny_snapshot_budget_evicts_lru_and_stays_correct(checkpoint, num_rows):
    path, expected = checkpoint
    per_row = state_bytes_per_slot(_llm(path, 4).engine.model)
    llm = _llm_with_snapshot_budget(path, 4, (num_rows + 0.5) * per_row / (1 << 30))
    assert llm.stats()["state_snapshots_total"] == num_rows
    assert _one_by_one(llm, PROMPTS) == expected[:3]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    if num_rows == 1:
        # The prompt's deepest boundary wins the only row (40, past the shared prefix):
        # followers find KV blocks but no state to resume from, and recompute.
        assert hits == 0
    else:
        # A's boundaries 40 and 36 fit; B resumes at 36 (pinned) and writes 48, evicting 40.
        assert hits == 2 * 36
    assert llm.stats()["state_snapshots_cached"] == num_rows
    _assert_nothing_held(llm)
    # A again: its own 40 was evicted; it resumes at the shared 36 (with one row, the one C wrote last).
    assert _one_by_one(llm, PROMPTS[:1]) == expected[:1]
    assert llm.stats()["prefix_cache_hit_tokens"] - hits == 36
    _assert_nothing_held(llm)


def test_snapshot_rows_and_slots_return_after_aborts_and_preemption(checkpoint):
    path, expected = checkpoint
    llm = _llm(path, 4)
    engine = llm.engine
    _set_budget(llm, 12, 4)  # chunked: aborts land mid-prefill
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
           for p in PROMPTS]
    for _ in range(3):
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    _assert_nothing_held(llm)
    # A KV pool too small for all three: preemption recomputes from the cache and the ids hold.
    from pagellm.runner.model_runner import kv_cache_bytes_per_block

    per_block = kv_cache_bytes_per_block(engine.model, 4, torch.float32)
    small = _llm(path, 4, kv_cache_memory=16 * per_block / (1 << 30), max_num_batched_tokens=16, n_ubatch=8,
                 max_model_len=64)
    got = [o.outputs[0].token_ids for o in small.generate(PROMPTS, [PARAMS] * len(PROMPTS), use_tqdm=False)]
    assert got == expected[:3]
    assert small.stats()["num_preemptions"] > 0
    _assert_nothing_held(small)


def test_boundary_at_the_end_of_a_block_aligned_prompt_is_snapshotted(checkpoint):
    path, expected = checkpoint
    llm = _llm(path, 4)
    _set_budget(llm, 13, 4)  # chunks 0-13, 13-26, 26-39, then token 39 alone (a one-token step)
    assert _one_by_one(llm, ALIGNED) == expected[3:]
    assert llm.stats()["prefix_cache_hit_tokens"] == 40  # the extension resumes after the whole prompt
    _assert_nothing_held(llm)
