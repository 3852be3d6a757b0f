"""Hybrid and MoE models through the whole engine: state slots, batching, chunking, preemption, aborts.

The oracle is HF transformers' greedy `generate` on the same tiny checkpoint; every
engine setting must give the same token ids.
"""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import write_hybrid_checkpoint

PROMPTS = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 23, 41, 70)]
MAX_TOKENS = [12, 7, 16, 9]  # staggered ends: the batch changes while requests decode


@pytest.fixture(scope="module", params=["qwen3-next", "qwen3.5-moe"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_hybrid_checkpoint(request.param, path)
    expected = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return path, expected


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, block_size=4,
               **{"kv_cache_memory": 0.01, "dtype": "float32", **kwargs})  # compared with HF fp32


@pytest.mark.parametrize("settings", [
    {},  # one batch, whole prompts
    {"max_num_batched_tokens": 16, "n_ubatch": 8},  # chunked prefill mixed with decodes
    {"max_num_seqs": 1},  # one request at a time
])
def test_engine_matches_hf_greedy(checkpoint, settings):
    path, expected = checkpoint
    llm = _llm(path, **settings)
    assert _generate(llm) == expected
    stats = llm.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0  # nothing leaked


def test_few_state_slots_make_requests_wait_not_fail(checkpoint):
    path, expected = checkpoint
    llm = _llm(path)
    per_slot = llm.engine.state_pool.num_slots  # default: one slot per max_num_seqs
    assert per_slot == 64
    from pagellm.runner.model_runner import state_bytes_per_slot

    two_slots = 2.5 * state_bytes_per_slot(llm.engine.model) / (1 << 30)
    small = _llm(path, state_cache_memory=two_slots)
    assert small.engine.state_pool.num_slots == 2
    assert _generate(small) == expected


def test_preemption_recomputes_state_and_keeps_greedy_ids(checkpoint):
    path, expected = checkpoint
    # 4-token blocks, a pool of ~40 blocks: the four requests cannot all stay resident.
    from pagellm.runner.model_runner import kv_cache_bytes_per_block

    probe = _llm(path)
    per_block = kv_cache_bytes_per_block(probe.engine.model, 4, torch.float32)
    llm = _llm(path, kv_cache_memory=40 * per_block / (1 << 30), max_model_len=160)
    assert _generate(llm) == expected
    assert llm.stats()["num_preemptions"] > 0


def test_aborts_return_state_slots_and_blocks(checkpoint):
    path, _ = checkpoint
    llm = _llm(path)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
           for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.stats()["state_slots_used"] == len(PROMPTS)
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    stats = engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0


def test_shared_prefix_resumes_from_a_state_snapshot(checkpoint):
    """A repeated prompt hits the KV blocks and the state snapshot at its last full block boundary
    below the last token (which is recomputed for its logits); more in test_hybrid_prefix_cache.py."""
    path, expected = checkpoint
    llm = _llm(path, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=0.0, ignore_eos=True)
    first = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again == expected[3]
    assert llm.stats()["prefix_cache_hit_tokens"] == (len(PROMPTS[3]) - 1) // 4 * 4  # 68 of 70 tokens
    assert llm.stats()["state_snapshots_used"] == 0


def test_a_bf16_state_halves_its_bytes_and_keeps_greedy_ids(checkpoint):
    """mamba_ssm_cache_dtype="bfloat16": the recurrent state is stored in bf16 (the rule still runs in fp32; its
    rounding is checked bit for bit in tests/layers/test_gated_delta_state_dtype.py). On these checkpoints the
    greedy ids stay HF's, whole prompts or chunked, and a repeated prompt resumes from a bf16 snapshot."""
    from pagellm.runner.model_runner import state_bytes_per_slot

    path, expected = checkpoint
    wide, narrow = _llm(path), _llm(path, mamba_ssm_cache_dtype="bfloat16", enable_prefix_caching=True)
    layers = narrow.engine.model.state_layers()
    assert {layer.recurrent_state.dtype for layer in layers} == {torch.bfloat16}
    halved = sum(layer.recurrent_state[0].numel() * 2 for layer in layers)
    assert state_bytes_per_slot(wide.engine.model) - state_bytes_per_slot(narrow.engine.model) == halved
    assert _generate(narrow) == expected
    assert _generate(narrow) == expected  # the same prompts again: from the snapshots
    assert narrow.stats()["prefix_cache_hit_tokens"] > 0
    assert _generate(_llm(path, mamba_ssm_cache_dtype="bfloat16", max_num_batched_tokens=16, n_ubatch=8)) == expected
