"""SnapshotPool and the hybrid-model prefix cache around it (KV manager, scheduler): no model involved."""

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.snapshot_pool import SnapshotPool
from pagellm.core.state_pool import StatePool
from pagellm.core.types import ModelOutput
from tests.core.core_builders import make_request

# ---- SnapshotPool alone ---------------------------------------------------------------------


def test_pending_snapshot_is_not_restorable_until_committed():
    pool = SnapshotPool(2, first_row=8)
    row = pool.allocate(block_hash=111, num_tokens=4)
    assert row == 8  # rows follow the running slots
    assert pool.lookup(111, 4) is None and pool.is_pending(111) and pool.contains(111)
    assert pool.num_used == 1 and pool.num_cached == 0
    pool.commit(row)
    assert pool.lookup(111, 4) == row and not pool.is_pending(111)
    assert pool.lookup(111, 8) is None  # same hash, other boundary: a collision guard
    assert pool.num_used == 0 and pool.num_cached == 1


def test_lru_eviction_spares_pinned_rows():
    pool = SnapshotPool(2)
    a, b = pool.allocate(1, 4), pool.allocate(2, 8)
    pool.commit(a)
    pool.commit(b)
    pool.acquire(a)  # a restore pins a: b is the only evictable row although a is older
    c = pool.allocate(3, 12)
    assert c == b and pool.lookup(2, 8) is None and not pool.contains(2)
    assert pool.allocate(4, 16) is None  # a pinned, c pending: nothing to hand out
    pool.commit(c)
    pool.release(a)
    # a was used (released) after c was committed: c is now least recently used
    assert pool.allocate(5, 20) == c and pool.lookup(1, 4) == a


def test_cancel_and_discard_free_rows_for_reuse_first():
    pool = SnapshotPool(3)
    rows = [pool.allocate(h, 4 * h) for h in (1, 2, 3)]
    pool.cancel(rows[0])  # its request left the step before it ran
    assert not pool.contains(1) and pool.num_available == 1
    for row in rows[1:]:
        pool.commit(row)
    pool.discard(2)  # the KV block under hash 2 was evicted: the snapshot can never hit
    assert not pool.contains(2) and pool.num_cached == 1
    pool.discard(99)  # unknown hash: nothing
    pinned = pool.lookup(3, 12)
    pool.acquire(pinned)
    pool.discard(3)  # in use this step: kept
    assert pool.lookup(3, 12) == pinned
    assert not pool.reset()  # refused while a row is pinned
    pool.release(pinned)
    assert pool.reset() and pool.num_cached == 0 and pool.num_available == 3


def test_misuse_raises():
    pool = SnapshotPool(1)
    row = pool.allocate(1, 4)
    with pytest.raises(ValueError):
        pool.allocate(1, 4)  # one snapshot per hash
    with pytest.raises(ValueError):
        pool.acquire(row)  # pending rows cannot be restored
    pool.commit(row)
    with pytest.raises(ValueError):
        pool.commit(row)
    with pytest.raises(RuntimeError):
        pool.release(row)


# ---- KVCacheManager with snapshots ------------------------------------------------------------


def _kv(num_blocks=16, num_rows=8):
    return KVCacheManager(num_blocks, 4, snapshots=SnapshotPool(num_rows, first_row=4))


def _prefill(kv, request, num_tokens=None):
    """Allocate and 'run' a chunk from the request's computed tokens; commit its snapshots."""
    start = request.num_computed_tokens
    end = request.num_tokens if num_tokens is None else start + num_tokens
    kv.allocate(request, end - start)
    writes = kv.plan_snapshots(request, start, end)
    for _, row in writes:
        kv.snapshots.commit(row)
    request.num_computed_tokens = end
    return writes


def test_hit_ends_at_the_last_block_with_a_snapshot():
    kv = _kv()
    a = make_request("a", range(14))
    writes = _prefill(kv, a)
    assert [p for p, _ in writes] == [4, 8, 12]  # every full prompt block boundary
    b = make_request("b", list(range(14)) + [7])
    hits, n = kv.find_cached_prefix(b)
    assert n == 12 and kv.restore_row(b, len(hits)) == dict(writes)[12]
    kv.snapshots.discard(a.block_hashes[2])  # e.g. LRU'd: the hit falls back to the previous boundary
    hits, n = kv.find_cached_prefix(b)
    assert n == 8 and len(hits) == 2 and kv.restore_row(b, 2) == dict(writes)[8]


def test_cap_below_the_last_token_rounds_down_to_a_snapshot():
    kv = _kv()
    _prefill(kv, make_request("a", range(12)))  # snapshots at 4, 8 and 12 (the whole prompt)
    hits, n = kv.find_cached_prefix(make_request("b", range(12)))
    assert n == 8  # 12 would leave no token to compute for the logits


def test_plan_snapshots_skips_existing_and_prefers_deepest_when_short():
    kv = _kv(num_rows=2)
    a = make_request("a", range(21), max_tokens=8)
    writes = kv.plan_snapshots(a, 2, 21)  # a chunk from position 2 (e.g. after a tiny first chunk)
    assert [p for p, _ in writes] == [16, 20]  # 4 boundaries, 2 rows: the deepest ones
    for _, row in writes:
        kv.snapshots.commit(row)
    assert [p for p, _ in kv.plan_snapshots(a, 8, 21)] == [12]  # 16, 20 exist; 12 evicts the LRU (16)
    assert kv.snapshots.contains(a.block_hashes[4]) and not kv.snapshots.contains(a.block_hashes[3])
    a.append_output_token(5)
    a.append_output_token(6)
    a.append_output_token(7)  # 24 tokens: block 5 is full, but generated tokens get no snapshots
    assert kv.plan_snapshots(a, 21, 24) == ()


def test_snapshots_every_interval_and_at_the_prompts_last_full_block():
    """state_snapshot_interval 8 over 4-token blocks: a 30-token prompt in two chunks gets snapshots at 8 and 16,
    then 24 and 28 (its last full block, where a chat's next turn branches off); a request sharing 26 tokens
    resumes at 24, one extending the whole prompt at 28."""
    kv = KVCacheManager(16, 4, snapshots=SnapshotPool(8, first_row=4), snapshot_interval=8)
    a = make_request("a", range(30))
    assert [p for p, _ in _prefill(kv, a, 20)] == [8, 16]
    assert [p for p, _ in _prefill(kv, a)] == [24, 28]
    assert kv.find_cached_prefix(make_request("b", list(range(26)) + [99] * 4))[1] == 24
    assert kv.find_cached_prefix(make_request("c", list(range(30)) + [5, 6]))[1] == 28
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        KVCacheManager(16, 4, snapshot_interval=6)
    with pytest.raises(ValueError, match="state_snapshot_interval must be a positive multiple of block_size 16"):
        CacheConfig(state_snapshot_interval=24)
    assert CacheConfig().snapshot_interval() == 64 and CacheConfig(block_size=128).snapshot_interval() == 128


def test_pending_snapshot_makes_newcomers_wait():
    kv = _kv()
    leader = make_request("a", range(10))
    kv.allocate(leader, 10)  # KV blocks 0-1 registered at allocation...
    writes = kv.plan_snapshots(leader, 0, 10)  # ...but their snapshots are written while the step runs
    follower = make_request("b", list(range(10)) + [3, 3])
    hits, n = kv.find_cached_prefix(follower)
    assert n == 0 and kv.is_prefix_in_flight(follower, 0)
    for _, row in writes:
        kv.snapshots.commit(row)
    hits, n = kv.find_cached_prefix(follower)
    assert n == 8 and not kv.is_prefix_in_flight(follower, 2)


def test_evicting_a_kv_block_drops_its_snapshot():
    kv = _kv(num_blocks=4)
    a = make_request("a", range(9))
    _prefill(kv, a)
    kv.free(a)
    assert kv.snapshots.num_cached == 2
    kv.allocate(make_request("b", range(50, 63)), 13)  # takes all 4 blocks, evicting a's cached ones
    assert kv.snapshots.num_cached == 0 and kv.snapshots.num_available == 8
    assert kv.reset_prefix_cache() is False  # b still holds blocks


# ---- Scheduler with snapshots -----------------------------------------------------------------


def _scheduler(num_blocks=64, num_rows=16, **kwargs):
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "n_ubatch": 4, **kwargs})
    kv = KVCacheManager(num_blocks, 4, snapshots=SnapshotPool(num_rows, first_row=8))
    return Scheduler(cfg, kv, 256, StatePool(8))


def _step(sched):
    out = sched.schedule()
    sampled = [item.request_id for item in out.scheduled if item.sample]
    for request, _ in sched.update(out, ModelOutput(tuple(sampled), tuple([7] * len(sampled)))):
        status = sched.check_length_stop(request)
        if status is not None:
            sched.finish(request.request_id, status)
    return out


def test_follower_waits_a_step_then_restores_the_leaders_snapshot():
    sched = _scheduler()
    sched.add_request(make_request("a", range(18)))
    sched.add_request(make_request("b", list(range(18)) + [1, 2, 3]))
    out = _step(sched)
    assert [item.request_id for item in out.scheduled] == ["a"]  # b waits for a's snapshots
    leader_writes = dict(out.scheduled[0].snapshot_writes)
    assert sorted(leader_writes) == [4, 8, 12, 16]
    out = sched.schedule()
    b = next(item for item in out.scheduled if item.request_id == "b")
    assert b.start_position == 16 and b.restore_snapshot == leader_writes[16]
    assert [p for p, _ in b.snapshot_writes] == [20]
    assert sched.kv_cache.snapshots.num_used == 2  # pinned source + b's pending write, until the step ran
    sched.update(out, ModelOutput(("a", "b"), (7, 7)))
    assert sched.kv_cache.snapshots.num_used == 0 and sched.requests["b"].num_cached_tokens == 16


def test_preemption_cancels_pending_snapshots_and_resumes_at_a_boundary():
    sched = _scheduler(num_blocks=6, max_num_batched_tokens=8)
    sched.add_request(make_request("old", range(8), max_tokens=12))
    sched.add_request(make_request("new", range(100, 108), max_tokens=12))
    restored = 0
    while sched.has_unfinished():
        out = _step(sched)
        assert sched.kv_cache.snapshots.num_used == 0  # nothing pinned or pending between steps
        for item in out.scheduled:
            if item.restore_snapshot is not None:
                restored += 1
                assert item.start_position in (4, 8)  # a resumed request restarts at a prompt boundary
    assert sched.num_preemptions > 0 and restored > 0
    assert sched.state_pool.num_used == 0 and sched.kv_cache.pool.num_used_blocks == 0
