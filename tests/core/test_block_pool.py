import pytest

from pagellm.core.block_pool import BlockPool


def test_allocate_takes_lowest_ids_first_and_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    with pytest.raises(RuntimeError):
        pool.allocate(2)


def test_unhashed_blocks_are_reused_first_and_hashed_ones_in_lru_order():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, 111, (1,))
    pool.cache_block(b, 222, (2,))
    pool.free([a])  # cached: goes to the back
    pool.free([c])  # no hash: goes to the front
    pool.free([b])  # cached, freed after a
    assert pool.free_block_ids() == [2, 0, 1]
    first = pool.allocate(1)[0]
    assert first.block_id == 2  # the unhashed block, so both cached blocks survive
    assert pool.num_cached_blocks == 2
    evicted = pool.allocate(1)[0]
    assert evicted.block_id == 0 and pool.lookup(111, (1,)) is None  # LRU cached block evicted first
    assert pool.lookup(222, (2,)) is b


def test_touch_revives_a_cached_block_from_the_middle_of_the_queue():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(b, 7, (5, 6))
    pool.free([a, b, c])
    assert pool.free_block_ids() == [2, 0, 1]
    pool.touch([b])
    assert b.ref_count == 1 and 1 not in pool.free_block_ids()
    assert pool.num_free_blocks == 2


def test_lookup_guards_against_hash_collisions():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 42, (1, 2, 3))
    assert pool.lookup(42, (1, 2, 3)) is a
    assert pool.lookup(42, (9, 9, 9)) is None  # same hash, other tokens: a miss, not wrong KV


def test_double_free_is_an_error():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])
