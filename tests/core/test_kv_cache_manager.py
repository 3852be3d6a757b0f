from pagellm.core.kv_cache_manager import KVCacheManager
from tests.core.core_builders import make_request


def test_allocate_maps_tokens_to_exact_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", range(10))
    new = kv.allocate(req, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate(req, 1) == []  # token 11 still fits in block 2
    req.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate(req, 1)] == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_allocate_returns_none_and_changes_nothing_when_it_does_not_fit():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", range(8))
    kv.allocate(a, 8)
    b = make_request("b", range(100, 109))
    free_before = kv.pool.free_block_ids()
    assert kv.allocate(b, 9) is None
    assert kv.pool.free_block_ids() == free_before and kv.block_ids("b") == []


def test_prefix_hit_is_capped_below_the_last_token_and_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", range(12))
    kv.allocate(a, 12)  # 3 full blocks, cached as they become full at the end of this step
    same = make_request("b", range(12))
    hits, n = kv.find_cached_prefix(same)
    assert [h.block_id for h in hits] == [0, 1] and n == 8  # the last token must be recomputed
    longer = make_request("c", list(range(12)) + [99])
    hits, n = kv.find_cached_prefix(longer)
    assert [h.block_id for h in hits] == [0, 1, 2] and n == 12
    kv.allocate(longer, 1, hits)
    assert kv.block_ids("c")[:3] == [0, 1, 2] and kv.pool.blocks[0].ref_count == 2


def test_chained_hash_needs_the_same_parent():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]), 9)
    other_parent = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert kv.find_cached_prefix(other_parent) == ([], 0)  # block 1 matches alone but not its chain


def test_freed_blocks_stay_cached_and_are_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(9))
    kv.allocate(a, 9)  # blocks 0, 1 full (cached); block 2 partial
    kv.free(a)
    # tail first: the partial block 2 (no hash) goes to the front, then 1, then 0 at the back
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    b = make_request("b", range(50, 63))
    kv.allocate(b, 13)  # needs 4 blocks: takes 2, 3, then evicts 1 before 0
    assert kv.block_ids("b") == [2, 3, 1, 0]
    assert kv.find_cached_prefix(make_request("c", range(9))) == ([], 0)


def test_revived_cached_blocks_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", range(9))
    kv.allocate(a, 9)
    kv.free(a)
    b = make_request("b", list(range(8)) + [77, 78, 79, 80, 81])
    hits, n = kv.find_cached_prefix(b)
    assert n == 8
    assert kv.allocate(b, 5, hits) is None  # 2 revived + 2 fresh > 3 free
    assert kv.pool.num_free_blocks == 3 and kv.pool.num_cached_blocks == 2


def test_in_flight_prefix_is_reported_until_cached():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    leader = make_request("a", range(16))
    kv.allocate(leader, 4)  # first chunk: block 0 computed this step, blocks 1-2 still to come
    follower = make_request("b", list(range(16)) + [5])
    hits, _ = kv.find_cached_prefix(follower)
    assert len(hits) == 1 and kv.is_prefix_in_flight(follower, 1)
    leader.num_computed_tokens = 4
    kv.allocate(leader, 12)
    hits, _ = kv.find_cached_prefix(follower)
    assert len(hits) == 4 and not kv.is_prefix_in_flight(follower, 4)


def test_no_leak_after_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    reqs = [make_request(str(i), range(i, i + 7)) for i in range(3)]
    for r in reqs:
        kv.allocate(r, 7, kv.find_cached_prefix(r)[0])
    for r in reqs:
        kv.free(r)
    assert kv.pool.num_free_blocks == 10 and all(b.ref_count == 0 for b in kv.pool.blocks)
