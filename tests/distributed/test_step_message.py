"""The head -> worker step message: exact round trip, and O(batch) bytes whatever the context length."""

from __future__ import annotations

import pytest

from pagellm.core.types import NewRequestData, ScheduledRequest, SchedulerOutput
from pagellm.distributed.protocol import decode_step, encode_step
from pagellm.sampling_params import SamplingParams


def _decode_step(batch: int, context: int) -> SchedulerOutput:
    items = tuple(ScheduledRequest(f"req-{i:04d}", i, (1000 + i,), context + i, (), True, state_slot=i)
                  for i in range(batch))
    return SchedulerOutput(items, num_decode_tokens=batch)


def test_round_trip_keeps_every_field_workers_use():
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=9)
    output = SchedulerOutput(
        (ScheduledRequest("a", 3, (5, 6, 7), 0, (4, 9), True, NewRequestData((5, 6, 7), (), params), 2, None,
                          ((16, 70),)),
         ScheduledRequest("b", 0, (1,), 300, (12,), True, None, 1, 40),
         ScheduledRequest("chunk", 1, tuple(range(64)), 64, (), False),
         ScheduledRequest("scored", 2, tuple(range(8)), 16, (3,), False, num_prompt_logits=8),
         ScheduledRequest("verify", 4, (8, 1, 2, 3), 40, (), True, state_slot=4, num_draft=3,
                          draft_state_rows=(60, 61, 62), rollback_state_row=59),
         ScheduledRequest("rolled-back", 5, (9,), 41, (), True, state_slot=5, rollback_state_row=66)),
        released_request_ids=("gone", "also-gone"), num_decode_tokens=1, num_prefill_tokens=75,
        released_blocks=(3, 4, 90), released_snapshot_rows=(17,))
    decoded = decode_step(encode_step(output))
    # Workers never sample, so prompt ids are not sent; everything else arrives unchanged.
    first = output.scheduled[0]
    expected = SchedulerOutput((ScheduledRequest(first.request_id, 3, (5, 6, 7), 0, (4, 9), True,
                                                 NewRequestData((), (), params), 2, None, ((16, 70),)),
                                *output.scheduled[1:]), output.released_request_ids, 1, 75,
                               released_blocks=(3, 4, 90), released_snapshot_rows=(17,))
    assert decoded == expected


def test_a_step_of_releases_only_reaches_the_workers():
    output = SchedulerOutput((), released_blocks=(7, 8), released_snapshot_rows=(2,))
    assert not output.is_empty and decode_step(encode_step(output)) == output


def test_steady_decode_bytes_do_not_grow_with_context():
    short = len(encode_step(_decode_step(32, context=20)))
    long = len(encode_step(_decode_step(32, context=100_000)))
    assert short == long
    # and grow linearly with the batch: a fixed cost per request, nothing per context token
    assert len(encode_step(_decode_step(64, 20))) - short == short - len(encode_step(_decode_step(0, 20)))


def test_trailing_garbage_is_rejected():
    with pytest.raises(ValueError, match="trailing bytes"):
        decode_step(encode_step(_decode_step(2, 5)) + b"x")


def test_a_worker_runner_fed_decoded_messages_reuses_steps_like_the_head(checkpoint):
    """Workers run the same ModelRunner on the decoded diffs: the same steps are prepared by diff."""
    from pagellm.config import CacheConfig, EngineConfig, ModelConfig
    from pagellm.engine import LLMEngine
    from pagellm.loader.model_loader import load_model
    from pagellm.runner.model_runner import ModelRunner, RankLinks
    from pagellm.sampling_params import SamplingParams

    config = EngineConfig(model=ModelConfig(model=str(checkpoint("llama"))), cache=CacheConfig(kv_cache_memory=0.01))
    engine = LLMEngine(config, skip_tokenizer_init=True)
    model = load_model(config.model.model, engine.dtype, engine.device, with_tokenizer=False).model
    # a worker's runner: it samples nothing (a world of one: nothing to all-reduce, the LM head whole)
    worker = ModelRunner(model, config, engine.backend, engine._runner_setup(),
                         RankLinks(lambda t: t, None, samples=False))
    head_reused, worker_reused = [], []
    launch = engine.executor.launch

    def mirrored(output):
        launched = launch(output)
        head_reused.append(launched.timings.reused_step)
        worker_reused.append(worker.execute(decode_step(encode_step(output))).timings.reused_step)
        return launched

    engine.executor.launch = mirrored
    for i, n in enumerate((6, 9, 12)):
        engine.add_request(list(range(3 + i, 30 + i)), SamplingParams(max_tokens=n, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert worker_reused == head_reused and sum(head_reused) >= 8
