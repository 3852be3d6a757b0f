import pytest

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.types import ModelOutput
from pagellm.request import RequestStatus
from tests.core.core_builders import make_request


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, **kwargs):
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "n_ubatch": 4, **kwargs})
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len)


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = [item.request_id for item in out.scheduled if item.sample]
    updated = sched.update(out, ModelOutput(tuple(sampled), tuple([token] * len(sampled))))
    for req, _ in updated:
        status = sched.check_length_stop(req)
        if status is not None:
            sched.finish(req.request_id, status)
    return out


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sched = make_scheduler()
    sched.add_request(make_request("short", range(5), max_tokens=20))
    run_step(sched)  # short: whole prompt, samples its first token
    sched.add_request(make_request("long", range(100, 200), max_tokens=4))
    out = run_step(sched)
    by_id = {item.request_id: item for item in out.scheduled}
    assert len(by_id["short"].token_ids) == 1  # the decode was not frozen
    assert len(by_id["long"].token_ids) == 31  # prefill budget max(n_ubatch, T - D) = 32 - 1
    assert not by_id["long"].sample
    steps = 1
    while sched.requests["long"].num_computed_tokens < 100:
        out = run_step(sched)
        assert "short" in {i.request_id for i in out.scheduled}
        steps += 1
    assert steps == 4  # 31 + 31 + 31 + 7


def test_prefill_budget_never_below_n_ubatch():
    sched = make_scheduler(max_num_batched_tokens=8, n_ubatch=4, max_num_seqs=16)
    for i in range(8):
        sched.add_request(make_request(f"d{i}", [i], max_tokens=50))
    run_step(sched)  # 8 one-token prompts
    sched.add_request(make_request("p", range(100, 140)))
    out = run_step(sched)
    assert out.num_decode_tokens == 8 and out.num_prefill_tokens == 4


def test_decode_stable_mode_admits_prefill_every_k_steps():
    sched = make_scheduler(decode_stable_interval=3)
    sched.add_request(make_request("d", range(3), max_tokens=30))
    run_step(sched)
    sched.add_request(make_request("p", range(50, 60)))
    admitted_at = None
    for step in range(2, 6):
        out = run_step(sched)
        if any(i.request_id == "p" for i in out.scheduled):
            admitted_at = sched.num_steps
            break
    assert admitted_at is not None and admitted_at % 3 == 0


def test_concurrent_requests_compute_a_shared_prefix_once():
    sched = make_scheduler(max_num_batched_tokens=64)
    prefix = list(range(300, 324))  # 6 full blocks of 4
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prefix + [i, i + 1, i + 2]))
    out = run_step(sched)
    fed = {item.request_id: len(item.token_ids) for item in out.scheduled}
    assert fed["r0"] == 27
    assert all(fed[f"r{i}"] == 3 for i in range(1, 4))  # each prefills only its own suffix
    assert all(sched.requests[f"r{i}"].num_cached_tokens == 24 for i in range(1, 4))


def test_follower_waits_for_a_chunked_leader_instead_of_recomputing():
    sched = make_scheduler(max_num_batched_tokens=8, n_ubatch=8)
    prefix = list(range(500, 532))  # 8 blocks, needs 4 steps at 8 tokens per step
    sched.add_request(make_request("lead", prefix + [1]))
    sched.add_request(make_request("follow", prefix + [2]))
    total_fed = 0
    for _ in range(12):
        out = run_step(sched)
        total_fed += sum(len(i.token_ids) for i in out.scheduled)
        if not sched.has_unfinished() or all(r.num_output_tokens for r in sched.requests.values()):
            break
    assert total_fed == 33 + 1  # lead computes the whole prompt; follow only its one-token suffix
    assert sched.requests["follow"].num_cached_tokens == 32


def test_preemption_frees_the_newest_and_it_resumes():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_request("old", range(8), max_tokens=12))
    sched.add_request(make_request("new", range(100, 108), max_tokens=12))
    run_step(sched)  # 2 + 2 blocks
    preempted_seen = False
    for _ in range(40):
        out = run_step(sched)
        if "new" in out.released_request_ids and sched.requests.get("new") is not None:
            preempted_seen = preempted_seen or sched.requests["new"].num_preemptions > 0
        if not sched.has_unfinished():
            break
    assert preempted_seen and sched.num_preemptions >= 1
    assert not sched.has_unfinished()
    assert sched.kv_cache.pool.num_free_blocks == 6  # no leak


def test_prompt_longer_than_context_or_pool_is_rejected():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="prompt is 17 tokens"):
        sched.add_request(make_request("big", range(17)))  # pool holds 16
    sched2 = make_scheduler(max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len 10"):
        sched2.add_request(make_request("ctx", range(10)))


def test_abort_returns_blocks_and_slot():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("a", range(10), max_tokens=100))
    sched.add_request(make_request("b", range(20, 30), max_tokens=100))
    run_step(sched)
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    sched.finish("b", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.pool.num_free_blocks == 16 and not sched.has_unfinished()
    out = sched.schedule()
    assert set(out.released_request_ids) == {"a", "b"}
    assert sorted(sched._free_slots) == list(range(8))


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), range(i * 10, i * 10 + 3), max_tokens=5))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def _state_scheduler(num_state_slots, num_blocks=64):
    from pagellm.core.state_pool import StatePool

    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, n_ubatch=4)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), 256, StatePool(num_state_slots))


def test_state_slots_cap_running_requests_and_the_rest_wait():
    sched = _state_scheduler(2)
    for i in range(4):
        sched.add_request(make_request(str(i), range(i * 10, i * 10 + 3), max_tokens=4))
    out = run_step(sched)
    assert [item.request_id for item in out.scheduled] == ["0", "1"]
    assert sorted(item.state_slot for item in out.scheduled) == [0, 1]
    assert len(sched.waiting) == 2 and sched.state_pool.num_free == 0
    seen = set()
    while sched.has_unfinished():
        out = run_step(sched)
        seen |= {item.request_id for item in out.scheduled}
        running_slots = [r.state_slot for r in sched.running]
        assert len(running_slots) == len(set(running_slots))  # never two requests in one slot
    assert seen == {"0", "1", "2", "3"} and sched.state_pool.num_free == 2


def test_state_slot_returns_on_abort_and_preemption():
    sched = _state_scheduler(4, num_blocks=6)
    sched.add_request(make_request("old", range(8), max_tokens=12))
    sched.add_request(make_request("new", range(100, 108), max_tokens=12))
    run_step(sched)
    assert sched.state_pool.num_used == 2
    while sched.num_preemptions == 0:
        run_step(sched)
    # The preempted request gave its slot back; it takes one again when it resumes.
    assert sched.state_pool.num_used == len(sched.running)
    sched.finish("old", RequestStatus.FINISHED_ABORTED)
    sched.finish("new", RequestStatus.FINISHED_ABORTED)
    assert sched.state_pool.num_free == 4


def test_prompt_logprobs_rows_cover_the_prompt_and_skip_the_prefix_cache():
    from pagellm.request import Request
    from pagellm.sampling_params import SamplingParams

    sched = make_scheduler(max_num_batched_tokens=8, n_ubatch=4)
    sched.add_request(make_request("warm", range(20), max_tokens=1))
    while sched.has_unfinished():
        run_step(sched)  # the 20-token prompt's 4 full blocks are cached now
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    sched.add_request(Request("scored", list(range(20)), params, block_size=4))
    sched.add_request(make_request("plain", range(20), max_tokens=1))
    rows, plain_rows = [], []
    while sched.has_unfinished():
        for item in run_step(sched).scheduled:
            (rows if item.request_id == "scored" else plain_rows).append((item.start_position, len(item.token_ids),
                                                                          item.num_prompt_logits))
    # no cache hit: chunks of 8 from position 0; row p scores token p + 1, so the last prompt row (19) is
    # only sampled, and the decode that follows scores nothing
    assert rows == [(0, 8, 8), (8, 8, 8), (16, 4, 3), (20, 1, 0)]
    assert sched.kv_cache.pool.num_used_blocks == 0
    assert plain_rows[0][0] == 16 and all(n == 0 for *_, n in plain_rows)  # others still hit the cache


def test_a_failed_step_sends_its_requests_back_and_the_cache_forgets_what_it_never_computed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=64)
    done = make_request("done", list(range(8)))
    sched.add_request(done)
    first = sched.schedule()
    sched.update(first, ModelOutput(("done",), (99,)))  # 8 prompt tokens computed: blocks 0-1 cached
    failing = make_request("fail", list(range(8)) + [50, 51, 52, 53, 54])
    sched.add_request(failing)
    step = sched.schedule()  # 'done' decodes; 'fail' reads blocks 0-1 from the cache, computes 8..12
    assert {item.request_id for item in step.scheduled} == {"done", "fail"}
    sched.recover_failed_step(step)
    assert {r.request_id for r in sched.waiting} == {"done", "fail"}
    assert not sched.running and kv.pool.num_used_blocks == 0 and sched.num_preemptions == 0
    probe = make_request("probe", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit_tokens = kv.find_cached_prefix(probe)
    assert num_hit_tokens == 8  # blocks 0-1 were computed by 'done'; block 2 (50..53) never was
    again = sched.schedule()  # both run again, from the cache
    assert {item.request_id for item in again.scheduled} == {"done", "fail"}
    assert all(item.new is not None for item in again.scheduled)  # the runner gets their slots anew
