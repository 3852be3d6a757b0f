"""A step waits for the device once: the read of its sampled ids. Counted on a CPU by recording the torch calls a
step makes: reads of tensor values into Python, and copies to a device that a CUDA build would run blocking
(from a list or pageable memory, or without non_blocking). On a GPU the device check counts real syncs."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import write_tiny_checkpoint

READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


class _HostWaits(TorchFunctionMode):
    """Names of the calls that would make the host wait for the device."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.blocking_copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if name in READS:
            self.reads.append(name)
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.blocking_copies.append(f"{name}(device=...)")  # a list copied straight to the device
        elif name in ("to", "copy_") and not kwargs.get("non_blocking") and not (len(args) > 2 and args[2] is True):
            if any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs or name == "copy_":
                self.blocking_copies.append(name)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint("llama", path)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01) as llm:
        yield llm.engine


def _steps(engine, params: list[SamplingParams]) -> list[tuple[int, _HostWaits, int]]:
    """(prefill tokens, what the step waited on, the host syncs it reported) of every step of `params`' requests:
    its launch and its collect together."""
    runner, seen, launched = engine.runner, [], {}
    launch, collect = runner.launch, runner.collect

    def counted_launch(output):
        waits = _HostWaits()
        with waits:
            step = launch(output)
        launched[id(step)] = (output, waits)
        return step

    def counted_collect(step):
        output, waits = launched.pop(id(step))
        with waits:
            result = collect(step)
        if output.scheduled:  # else a step that only released KV pages (an idle engine's): no model, no read
            seen.append((output.num_prefill_tokens, waits, result.timings.host_syncs))
        else:
            assert waits.reads == [] and waits.blocking_copies == []
        return result

    runner.launch, runner.collect = counted_launch, counted_collect
    try:
        for i, p in enumerate(params):
            engine.add_request([5 + i, 6, 7, 8], p)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del runner.launch, runner.collect
    return seen


EVERY_FIELD = SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3, ignore_eos=True,
                             logit_bias={3: 2.0, 9: -1.0}, presence_penalty=0.5, frequency_penalty=0.2,
                             repetition_penalty=1.1, min_tokens=3, stop_token_ids=[4], logprobs=2)


@pytest.mark.parametrize("params", [
    [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)],
    [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), EVERY_FIELD,
     SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)],
], ids=["greedy", "every-sampling-field"])
def test_a_step_reads_the_device_once_and_copies_to_it_without_waiting(engine, params):
    steps = _steps(engine, params)
    assert any(prefill == 0 for prefill, _, _ in steps)  # pure decode steps ran (the reused buffers' path)
    for prefill, waits, reported in steps:
        assert waits.blocking_copies == [], (prefill, waits.blocking_copies)
        assert waits.reads == ["tolist"] and reported == 1, (prefill, waits.reads)


def test_prompt_logprobs_are_a_second_read_and_reported(engine):
    steps = _steps(engine, [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, ignore_eos=True)])
    prefill, waits, reported = steps[0]
    assert prefill > 0 and waits.blocking_copies == []
    assert len(waits.reads) == reported == 2


def test_steps_launched_ahead_fill_their_tokens_on_the_device(checkpoint):
    """Async scheduling: a decode fed the previous step's token takes it on the device, with no read."""
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01, async_scheduling=True) as llm:
        steps = _steps(llm.engine, [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2)
        assert llm.stats()["steps_launched_ahead"] >= 5
    for prefill, waits, reported in steps:
        assert waits.blocking_copies == [] and waits.reads == ["tolist"] and reported == 1, (prefill, waits.reads)
