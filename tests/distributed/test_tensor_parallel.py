"""Two ranks on loopback (Gloo) give the same greedy tokens as one process, and logprobs within 1e-4.

Each test starts the head in this process and a worker process (spawned, or joined by hand as
`pagellm worker` would from another host), so these are real multi-process runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagellm.distributed.worker import free_port
from pagellm.engine import LLMEngine

PROMPTS = [[5, 9, 13, 200, 7, 3, 44, 19, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 8, 100], list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)


def _generate(path, **kwargs):
    kwargs = {"dtype": "float32", **kwargs}  # ranks sum partial products in another order: exact in fp32 only
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, **kwargs) as llm:
        return [out.outputs[0] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm.stats()


@pytest.mark.parametrize("family,expert_parallel", [
    ("llama", False), ("gemma3", False),  # gemma3: 2 kv heads of 4 q heads, soft-capped logits
    ("qwen3-moe", False), ("qwen3-moe", True),
    ("qwen3-next", False), ("qwen3-next", True),  # Gated DeltaNet split by key-head group; shared expert
    ("qwen3.5", False),
])
def test_two_ranks_match_one_process(checkpoint, family, expert_parallel):
    path = checkpoint(family)
    single, _ = _generate(path)
    split, stats = _generate(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                             distributed_timeout=30)
    assert stats["tensor_parallel_size"] == 2
    for one, two in zip(single, split):
        assert two.token_ids == one.token_ids
        for a, b in zip(one.logprobs, two.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("family", ["llama", "qwen3.5"])
def test_speculative_decoding_over_two_ranks_matches_one_process(checkpoint, family):
    """Verify steps reach the workers (their every position through the vocab-parallel LM head) and a hybrid
    model's state rolls back on every rank: the greedy ids of one process without speculation."""
    path = checkpoint(family)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 11]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32") as llm:
        single = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", tensor_parallel_size=2,
             distributed_timeout=30, speculative_config=spec) as llm:
        split = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert split == single
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_released_blocks_over_two_ranks_keep_the_tokens(checkpoint):
    """No idle block kept: every request's blocks are released on both ranks (the worker's in steps that carry
    only the release), and written again by the next generate."""
    path = checkpoint("llama")
    single, _ = _generate(path)
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", prefix_cache_memory=0,
             tensor_parallel_size=2, distributed_timeout=30) as llm:
        runs = [[out.outputs[0] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] for _ in range(2)]
        stats = llm.stats()
    assert stats["kv_blocks_released"] > 0 and stats["kv_resident_bytes"] == 0
    for outputs in runs:
        assert [o.token_ids for o in outputs] == [o.token_ids for o in single]


def test_prompt_logprobs_over_two_ranks_match_one_process(checkpoint):
    """Prompt rows, chunked, go through the vocab-parallel LM head in the same passes on every rank."""
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2), GREEDY,
              SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0)]
    outs = []
    for parallel in ({}, {"tensor_parallel_size": 2, "distributed_timeout": 30}):
        with LLM(str(checkpoint("llama")), dtype="float32", quantization="none", skip_tokenizer_init=True,
                 kv_cache_memory=0.01, max_num_batched_tokens=16, n_ubatch=16, **parallel) as llm:
            assert not parallel or llm.engine.runner.vocab_parallel
            outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
    for one, two in zip(*outs):
        assert [o.token_ids for o in one.outputs] == [o.token_ids for o in two.outputs]
        assert (one.prompt_logprobs is None) == (two.prompt_logprobs is None)
        for a, b in zip(one.prompt_logprobs or (), two.prompt_logprobs or ()):
            assert (a is None and b is None) or (a.keys() == b.keys() and all(
                abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a))


def _start_remote_worker(port: int, world_size: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagellm", "worker", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--rank", "1", "--world-size", str(world_size),
                             "--join-timeout", "60", *extra], stderr=subprocess.PIPE, text=True)


def _remote_head(path, port: int, **parallel) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"), cache=CacheConfig(kv_cache_memory=0.01),
                          parallel=ParallelConfig(tensor_parallel_size=2, spawn_workers=False, master_port=port,
                                                  join_timeout=60, **parallel))
    return LLMEngine(config, skip_tokenizer_init=True)


def _run_alone(path, prompt, params):
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32") as llm:
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_joined_worker_serves_arrivals_and_completions_with_o_batch_messages(checkpoint):
    """A worker joined by hand (as from another host); requests arrive and finish while others run."""
    path = checkpoint("qwen3-next")
    port = free_port("127.0.0.1")
    worker = _start_remote_worker(port, 2)
    engine = _remote_head(path, port)
    try:
        assert engine.runner.vocab_parallel  # each rank multiplies by half the LM head's rows
        long_prompt, short_prompt = list(range(3, 200)), [9, 8, 7]
        plan = {0: ("a", long_prompt, 12), 3: ("b", short_prompt, 4), 5: ("c", list(range(50, 90)), 9)}
        finished, step, steady_bytes, reuse_hits = {}, 0, {}, 0
        while step in plan or engine.has_unfinished_requests():
            if step in plan:
                rid, prompt, n = plan[step]
                engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0), request_id=rid)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            stats = engine.stats()
            running = tuple(sorted(r.request_id for r in engine.scheduler.running))
            reused, reuse_hits = stats["step_reuse_hits"] > reuse_hits, stats["step_reuse_hits"]
            if stats["computed_prefill_tokens"] and reused:
                steady_bytes.setdefault(running, set()).add(stats["step_message_bytes_last"])
            step += 1
        for rid, prompt, n in plan.values():
            assert finished[rid] == _run_alone(path, prompt, SamplingParams(max_tokens=n, temperature=0.0))
        # A steady decode step sends the same bytes while contexts grow (positions are fixed-width).
        assert steady_bytes and all(len(sizes) == 1 for sizes in steady_bytes.values())
        assert max(max(s) for s in steady_bytes.values()) < 300  # ~40 bytes per request, 16 of header
    finally:
        engine.shutdown()
        assert worker.wait(timeout=30) == 0


def test_mismatched_world_size_is_a_clear_error_on_both_sides(checkpoint):
    port = free_port("127.0.0.1")
    worker = _start_remote_worker(port, 3)
    with pytest.raises(RuntimeError, match="started with world size 3, the head has 2"):
        _remote_head(checkpoint("llama"), port)
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 2 and "world size 3" in err


def test_unreachable_head_is_a_clear_error():
    port = free_port("127.0.0.1")  # nothing listens here
    # --join-timeout: how long the worker keeps trying, which is all this test waits out; one second is ample
    result = subprocess.run([sys.executable, "-m", "pagellm", "worker", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--rank", "1", "--world-size", "2", "--join-timeout", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot reach the head at 127.0.0.1:{port}" in result.stderr


def test_structured_output_over_two_ranks_matches_one_process(tiny_qwen3_with_the_embedded_tokenizer):
    """The head samples with the grammar masks; workers, which hold no matcher, still follow the same steps."""
    import json
    import re

    from pagellm.sampling_params import StructuredOutputs

    path = tiny_qwen3_with_the_embedded_tokenizer  # the session's (tests/conftest.py): its chat template is unused
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json=schema)),
              SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputs(regex=r"[a-c]{3}-\d")),
              SamplingParams(max_tokens=8, temperature=0.0)]
    runs = []
    for size in (1, 2):
        with LLM(str(path), kv_cache_memory=0.01, tensor_parallel_size=size) as llm:
            runs.append([o.outputs[0] for o in llm.generate(["Answer:"] * 3, params, use_tqdm=False)])
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    json_out, regex_out, _ = runs[1]
    assert json.loads(json_out.text)["a"] in ("x", "yy") and re.fullmatch(r"[a-c]{3}-\d", regex_out.text)
