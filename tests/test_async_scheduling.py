"""Async scheduling (engine.py): each step is launched before the previous one's tokens are read back, its
decodes fed those tokens on the device. Every request must get exactly the tokens it gets without it, under
arrivals, finishes, stop tokens, aborts, preemption, prefix caching, chunked prefill and every sampling field."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.types import PLACEHOLDER
from pagellm.runner.model_runner import kv_cache_bytes_per_block
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint("llama", path, redraw=True)  # varied greedy ids, so a misplaced token shows
    return path


def _greedy(n: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **fields)


def _run(path, async_scheduling: bool, script: dict, **engine_args):
    """script: {step index: [("add", prompt, params) | ("abort", request number)]}, applied before that step.
    -> ({request number: (tokens, finish reason)}, stats, every step's scheduled token ids)."""
    with LLM(str(path), skip_tokenizer_init=True, async_scheduling=async_scheduling,
             **{"kv_cache_memory": 0.01, **engine_args}) as llm:
        engine, ids, results, fed = llm.engine, {}, {}, []
        schedule = engine.scheduler.schedule

        def recorded(*proposals):
            output = schedule(*proposals)
            fed.append([item.token_ids for item in output.scheduled])
            return output

        engine.scheduler.schedule = recorded
        step = 0
        while step <= max(script) or engine.has_unfinished_requests():
            for action, *args in script.get(step, ()):
                if action == "add":
                    ids[engine.add_request(*args)] = len(ids)
                else:
                    engine.abort(next(rid for rid, n in ids.items() if n == args[0]))
            for out in engine.step():
                results[ids[out.request_id]] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            step += 1
        return results, llm.stats(), fed


def _same_with_and_without(path, script, **engine_args):
    plain, _, _ = _run(path, False, script, **engine_args)
    overlapped, stats, fed = _run(path, True, script, **engine_args)
    assert overlapped == plain
    assert stats["steps_launched_ahead"] > 0 and any(PLACEHOLDER in ids for step in fed for ids in step)
    return plain, stats


ARRIVALS = {0: [("add", [5, 6, 7], _greedy(9)), ("add", [8, 9], _greedy(4))],
            2: [("add", [10, 11, 12, 13], _greedy(7))],
            3: [("add", [5, 6, 7, 1], _greedy(6))],  # shares a prefix with the first
            6: [("add", [14] * 20, _greedy(5))]}


@pytest.mark.parametrize("engine_args", [
    {}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 8, "n_ubatch": 4}, {"pool_blocks": 7},
], ids=["default", "prefix-cache-off", "chunked-prefill", "preemption"])
def test_greedy_ids_are_the_same_under_arrivals_and_finishes(checkpoint, engine_args):
    """pool_blocks: a KV pool of that many blocks of 4 tokens, too small for every request at once."""
    blocks = engine_args.pop("pool_blocks", None)
    if blocks is not None:
        engine_args.update(block_size=4, kv_cache_memory=blocks * _block_bytes(checkpoint, 4) / 2**30)
    plain, stats = _same_with_and_without(checkpoint, ARRIVALS, **engine_args)
    assert [len(plain[n][0]) for n in range(5)] == [9, 4, 7, 6, 5]
    assert blocks is None or stats["num_preemptions"] > 0


def _block_bytes(path, block_size: int) -> int:
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01) as llm:
        return kv_cache_bytes_per_block(llm.engine.model, block_size, llm.engine.kv_cache_dtype)


def test_stop_tokens_and_aborts_end_requests_where_they_do_without(checkpoint):
    """A stop token read back at step N ends the request there; the step launched ahead with it drops its token.
    An abort between steps leaves what was delivered."""
    first, _, _ = _run(checkpoint, False, {0: [("add", [5, 6, 7], _greedy(12))]})
    stop = first[0][0][4]  # the fifth greedy token becomes a stop token
    script = {0: [("add", [5, 6, 7], _greedy(12, stop_token_ids=[stop])), ("add", [8, 9], _greedy(12))],
              4: [("abort", 1)], 5: [("add", [10, 11], _greedy(3))]}
    plain, _ = _same_with_and_without(checkpoint, script)
    assert plain[0][1] == "stop" and plain[0][0][-1] == stop
    assert plain[1][1] is None and len(plain[1][0]) < 12  # aborted: its last delivered output stands


def test_every_sampling_field_gives_the_same_tokens(checkpoint):
    """Seeded sampling draws from (seed, tokens so far), counting those on their way; min_tokens counts them too.
    Penalties and logprobs run as well (a penalised request's steps are not launched ahead)."""
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    script = {0: [("add", [5, 6, 7], seeded),
                  ("add", [8, 9], _greedy(8, min_tokens=5, stop_token_ids=[0, 1, 2, 3], logprobs=2)),
                  ("add", [3, 4], SamplingParams(max_tokens=6, temperature=0.0, presence_penalty=1.0,
                                                 logit_bias={2: 3.0}, ignore_eos=True))]}
    _same_with_and_without(checkpoint, script)


def test_a_request_launched_ahead_at_its_last_token_is_not(checkpoint):
    """max_tokens is known ahead: the step after a request's last token does not run it."""
    _, _, fed = _run(checkpoint, True, {0: [("add", [5, 6, 7], _greedy(3))]})
    assert [len(step) for step in fed if step] == [1, 1, 1]  # the prompt, then two decodes: no wasted fourth


def test_async_scheduling_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        LLM(tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_a_hybrid_model_gives_the_same_ids_with_steps_launched_ahead(tmp_path, family):
    """A step launched ahead updates the recurrent state slots after the step before it (one stream), and a
    snapshot it writes is restorable only once its step is read back, as without: arrivals, a shared prefix,
    chunked prefill, a stop token and an abort give the same tokens."""
    write_hybrid_checkpoint(family, tmp_path)
    script = {**ARRIVALS, 1: [("add", [8, 9], _greedy(8, stop_token_ids=list(range(40))))], 4: [("abort", 1)]}
    _same_with_and_without(tmp_path, script, block_size=4, max_num_batched_tokens=8, n_ubatch=4)


def test_unset_async_scheduling_follows_the_decode_graphs(checkpoint):
    """Unset, steps overlap only where decodes replay CUDA graphs (an eager step keeps the host busy): on a CPU
    they never do; asked for, they overlap on a CPU too."""
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01) as llm:
        llm.generate([[5, 6, 7]], _greedy(4), use_tqdm=False)
        stats = llm.stats()
    assert stats["async_scheduling"] is False and stats["steps_launched_ahead"] == 0
    assert stats["decode_graphs"] == "off (eager)"
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01, async_scheduling=True) as llm:
        llm.generate([[5, 6, 7]], _greedy(4), use_tqdm=False)
        stats = llm.stats()
    assert stats["async_scheduling"] is True and stats["steps_launched_ahead"] > 0


@pytest.mark.parametrize("failing", ["launch", "collect"])
def test_a_failed_step_recovers_both_steps_and_the_ids_stand(checkpoint, monkeypatch, failing):
    """A step launched ahead fails at its launch, or a step fails when read back with the next one launched:
    both go back to waiting, a StepError names the first, and every request still gets its tokens."""
    from pagellm.engine_errors import StepError
    from pagellm.runner.model_runner import ModelRunner

    script = {0: [("add", [5, 6, 7], _greedy(6)), ("add", [8, 9], _greedy(5))]}
    plain, _, _ = _run(checkpoint, False, script)
    real, calls = getattr(ModelRunner, failing), []

    def fails_once(self, arg):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(self, arg)

    monkeypatch.setattr(ModelRunner, failing, fails_once)
    with LLM(str(checkpoint), skip_tokenizer_init=True, async_scheduling=True, kv_cache_memory=0.01) as llm:
        engine, errors, results = llm.engine, [], {}
        numbers = {engine.add_request(*args): n for n, (_, *args) in enumerate(script[0])}
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except StepError as exc:
                errors.append(exc)
                continue
            for out in outputs:
                results[numbers[out.request_id]] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    assert len(errors) == 1 and str(errors[0].cause) == "injected" and results == plain


def test_a_launch_that_fails_names_its_own_requests_and_an_id_in_flight_is_not_reused(checkpoint, monkeypatch):
    """A request admitted in the step launched ahead that fails there is the suspect, not the running ones; and
    an aborted request whose last step still runs keeps its id until that step is read back."""
    from pagellm.engine_errors import StepError
    from pagellm.runner.model_runner import ModelRunner

    with LLM(str(checkpoint), skip_tokenizer_init=True, async_scheduling=True, kv_cache_memory=0.01) as llm:
        engine = llm.engine
        engine.add_request([5, 6, 7], _greedy(8), request_id="running")
        engine.step()
        engine.step()  # "running" decodes; a step of it is in flight
        real = ModelRunner.launch

        def fails_for_new(self, output):
            if any(item.request_id == "new" for item in output.scheduled):
                raise RuntimeError("injected")
            return real(self, output)

        monkeypatch.setattr(ModelRunner, "launch", fails_for_new)
        engine.add_request([8, 9], _greedy(2), request_id="new")
        with pytest.raises(StepError) as failed:
            engine.step()
        assert "new" in failed.value.request_ids  # the step that raised (before: only the step before it)
        monkeypatch.undo()
        engine.abort("new")
        engine.step()  # "running" again, with a step in flight
        engine.abort("running")
        with pytest.raises(ValueError, match="'running' is still in use"):
            engine.add_request([5], _greedy(1), request_id="running")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request([5], _greedy(1), request_id="running")  # its step read back: the id is free


def test_a_failed_step_forgets_the_blocks_of_a_request_aborted_while_it_ran(checkpoint, monkeypatch):
    """A request aborted while the step computing its prompt is in flight, then that step fails: the blocks the
    step registered in the prefix cache (at schedule time) were never computed, so none may stay cached for a
    later request to read."""
    from pagellm.engine_errors import StepError
    from pagellm.runner.model_runner import ModelRunner

    with LLM(str(checkpoint), skip_tokenizer_init=True, async_scheduling=True, kv_cache_memory=0.01) as llm:
        engine = llm.engine
        engine.add_request([5, 6, 7], _greedy(20), request_id="a")
        engine.step()  # a's prefill read back, a's first decode in flight
        prompt = list(range(10, 50))  # two full blocks of 16
        engine.add_request(prompt, _greedy(4), request_id="r")
        engine.step()  # the step with r's prefill is in flight
        assert engine._in_flight is not None and "r" in [i.request_id for i in engine._in_flight.output.scheduled]
        hashes = engine.scheduler.requests["r"].block_hashes[:2]
        assert engine.abort("r")
        real = ModelRunner.collect
        monkeypatch.setattr(ModelRunner, "collect", lambda self, arg: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(StepError):
            engine.step()
        monkeypatch.setattr(ModelRunner, "collect", real)
        assert not [h for h in hashes if h in engine.kv_cache.pool.cached]
        while engine.has_unfinished_requests():
            engine.step()


def test_requests_that_may_speculate_wait_for_their_tokens_and_the_rest_launch_ahead(checkpoint):
    """A decode launched ahead cannot look its drafts up (its last token is on its way): with speculation on, a
    step whose requests may propose is not launched ahead, so verify steps happen and the ids stand; past
    disable_by_batch_size decodes nothing speculates and steps launch ahead again."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False,
            "disable_by_batch_size": 2}
    repeating = {0: [("add", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], _greedy(16)), ("add", [3, 4] * 6, _greedy(16))]}
    plain, _, _ = _run(checkpoint, False, repeating)
    overlapped, stats, _ = _run(checkpoint, True, repeating, speculative_config=spec)
    assert overlapped == plain and stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    crowded = {0: [("add", [5 + i, 6, 7, 8] * 3, _greedy(8)) for i in range(3)]}  # three decodes a step
    plain, _, _ = _run(checkpoint, False, crowded)
    overlapped, stats, _ = _run(checkpoint, True, crowded, speculative_config=spec)
    assert overlapped == plain and stats["spec_draft_tokens"] == 0 and stats["steps_launched_ahead"] > 0
