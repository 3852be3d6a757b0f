"""The hybrid families' decode step modes give eager's greedy ids (bench/device_steps.same_ids): on a CUDA device
its captured graphs and async scheduling, over real state slots and expert routing; on a CPU async scheduling."""

import pytest

from pagellm.bench import device_steps
from tests.gpu import DEVICE, ON_GPU
from tests.models.tiny_checkpoints import write_hybrid_checkpoint


@pytest.mark.parametrize("family", ["qwen3.5-moe", "qwen3-next"])
def test_each_step_mode_gives_eagers_greedy_ids(family, tmp_path):
    write_hybrid_checkpoint(family, tmp_path)
    checks = device_steps.same_ids(DEVICE, tmp_path)
    assert set(checks) == {"eager", *device_steps.modes_for(DEVICE)}
    assert all(check["ok"] for check in checks.values()), checks
    assert checks["async"]["steps_launched_ahead"] > 0
    if ON_GPU:  # most decode steps replay a graph once the buckets are captured
        assert checks["graphs-async"]["graph_replays"] >= checks["graphs-async"]["decode_steps"] // 2, checks


@pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs; tests/runner/test_verify_graphs.py checks the same "
                                       "logic on a CPU with the replaying stand-in")
@pytest.mark.parametrize("family", ["qwen3.5-moe", "qwen3-next"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_speculative_verify_steps_replay_graphs_with_the_greedy_ids(family, state_dtype, tmp_path):
    """On the device's defaults (graphs, async scheduling): a hybrid model's verify steps replay their graphs, the
    DeltaNet's state rolled back from the rows those graphs wrote, with the ids of a run without speculation (a
    bf16 state too: a verify step rounds it after each token, as decode steps do)."""
    from pagellm import LLM, SamplingParams
    from tests.runner.test_speculative_engine import NGRAM, PROMPTS

    write_hybrid_checkpoint(family, tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    args = dict(skip_tokenizer_init=True, device=DEVICE, dtype="float32", kv_cache_memory=0.05,
                mamba_ssm_cache_dtype=state_dtype)
    with LLM(str(tmp_path), **args) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(tmp_path), speculative_config=NGRAM, **args) as llm:
        spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        replays, stats = llm.engine.runner.verify_graphs.replays, llm.stats()
    assert spec == plain and replays > 0 and stats["spec_accepted_tokens"] > 0, stats
