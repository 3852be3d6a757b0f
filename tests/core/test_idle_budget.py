"""Resident memory follows the work: the pool reuses resident blocks before untouched ones, and keeps at most
`idle_budget` blocks resident that no request holds, releasing the rest (core/block_pool.py). No model."""

import pytest

from pagellm.config import SchedulerConfig
from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.snapshot_pool import SnapshotPool
from pagellm.core.state_pool import StatePool
from pagellm.core.types import ModelOutput
from tests.core.core_builders import make_request


def test_freed_blocks_are_reused_before_untouched_ones_and_cached_ones_last():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)  # 0, 1, 2 written; 3, 4, 5 never touched
    pool.cache_block(a, 11, (1,))
    pool.free([c, b, a])  # tail first: c, b warm, a cached
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 0]  # warm (newest first), cold, cached
    assert pool.num_resident_blocks == 3 and pool.num_idle_resident_blocks == 3
    assert [x.block_id for x in pool.allocate(3)] == [1, 2, 3]  # block 3 is the first one faulted in
    assert pool.lookup(11, (1,)) is a  # the cached block is still there: untouched blocks went first
    assert pool.num_resident_blocks == 4


def test_without_a_budget_nothing_is_released():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 100 + i, (i,))
    pool.free(blocks)
    assert pool.released.take() == () and pool.num_resident_blocks == 4 and pool.num_cached_blocks == 4


def test_cached_blocks_past_the_budget_turn_warm_and_warm_ones_past_it_are_released():
    pool = BlockPool(12, idle_budget=2)
    a, b, c, d = pool.allocate(4)
    for block, h in ((a, 1), (b, 2), (c, 3)):
        pool.cache_block(block, h, (h,))
    pool.free([a])
    pool.free([b])
    pool.free([d, c])  # d (no hash) turns warm, c cached: 3 cached for a budget of 2
    assert pool.lookup(1, (1,)) is None and pool.lookup(2, (2,)) is b and pool.lookup(3, (3,)) is c
    assert pool.free_block_ids()[:2] == [0, 3]  # a lost its hash to the budget but stays warm: reused first
    assert pool.released.take() == () and pool.num_resident_blocks == 4
    more = pool.allocate(3)  # a, d, then block 4
    pool.free(more)
    assert pool.released.take() == (0,)  # 3 warm for a budget of 2: the oldest goes back
    pool.release_warm()  # the engine has nothing to run
    assert pool.released.take() == (3, 4) and pool.num_idle_resident_blocks == 2 == pool.num_resident_blocks
    assert pool.num_released_total == 3
    assert [x.block_id for x in pool.allocate(2)] == [4, 3]  # released blocks are cold again: before the cached
    assert pool.num_cached_blocks == 2


def test_a_zero_budget_keeps_nothing_idle_but_live_requests_still_share():
    pool = BlockPool(4, idle_budget=0)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, (5,))
    pool.touch([a])  # a second holder
    pool.free([a])
    assert pool.lookup(5, (5,)) is a and pool.released.take() == ()  # still held: no release
    pool.free([a])
    assert pool.lookup(5, (5,)) is None and pool.released.take() == (0,)


def test_a_released_block_is_listed_once_even_if_reused_and_released_again():
    pool = BlockPool(2, idle_budget=0)
    (a,) = pool.allocate(1)
    pool.free([a])
    (again,) = pool.allocate(1)
    pool.free([again])
    assert again is a and pool.released.take() == (0,) and pool.num_released_total == 2


def test_uncache_and_reset_turn_free_cached_blocks_warm():
    pool = BlockPool(4, idle_budget=4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1, (1,))
    pool.cache_block(b, 2, (2,))
    pool.free([b, a])
    pool.uncache(a)
    assert pool.free_block_ids() == [0, 2, 3, 1]
    pool.reset_prefix_cache()
    assert pool.free_block_ids() == [1, 0, 2, 3] and pool.num_cached_blocks == 0
    assert pool.num_idle_resident_blocks == 2


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="idle_budget"):
        BlockPool(2, idle_budget=-1)


def test_finished_requests_keep_at_most_the_budget_and_steps_carry_the_releases():
    kv = KVCacheManager(num_blocks=32, block_size=4, idle_budget=3)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", range(100 * i, 100 * i + 9), max_tokens=1))
    output = scheduler.schedule()
    assert output.released_blocks == () and kv.pool.num_resident_blocks == 9  # 3 blocks each
    scheduler.update(output, ModelOutput(("r0", "r1", "r2"), (1, 2, 3)))
    for i in range(3):
        scheduler.finish(f"r{i}", scheduler.requests[f"r{i}"].status)
    assert kv.pool.num_idle_resident_blocks == 6 and kv.has_released()  # 3 cached, 3 warm, 3 released
    kv.release_warm()  # as the engine does once it has nothing to run
    released = scheduler.schedule().released_blocks  # nothing to run: a step that only releases
    assert len(released) == 6 and not kv.has_released()
    assert kv.pool.num_resident_blocks == 3 and kv.pool.num_cached_blocks == 3  # r2's two prefix blocks, r1's last
    again = make_request("again", range(200, 209))
    hits, num_hit = kv.find_cached_prefix(again)
    assert num_hit == 8  # the newest prompt's prefix survived the budget


def test_snapshots_of_released_blocks_are_released_too():
    snapshots = SnapshotPool(4, first_row=2)
    kv = KVCacheManager(num_blocks=16, block_size=4, snapshots=snapshots, idle_budget=1)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, max_model_len=64,
                          state_pool=StatePool(2))
    scheduler.add_request(make_request("a", range(9), max_tokens=1))
    output = scheduler.schedule()
    rows = [row for _, row in output.scheduled[0].snapshot_writes]
    assert len(rows) == 2  # the state after blocks 0 and 1
    scheduler.update(output, ModelOutput(("a",), (7,)))
    scheduler.finish("a", scheduler.requests["a"].status)
    # budget 1: block 1 (freed tail first: the LRU cached one) loses its hash, its snapshot row is released; the
    # oldest warm block (the partial one) goes
    assert kv.take_released() == ((2,), (rows[1],))
    kv.release_warm()
    assert kv.take_released() == ((1,), ())
    assert snapshots.num_cached == 1 and kv.find_cached_prefix(make_request("b", range(9)))[1] == 4
