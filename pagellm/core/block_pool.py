"""BlockPool: the KV blocks, their reference counts, an LRU free queue and the prefix-hash map.

    free queue (LRU first)                      hash -> block map
    head <-> b7 <-> b3 <-> b9 <-> tail          H(b3) -> b3, H(b9) -> b9
             ^ no hash: reused first            (cached blocks stay in the free
                                                 queue until a new block is needed)

A block with ref_count 0 sits in the free queue; if it still has a hash it is a
cached block that a later request can revive in O(1) by unlinking it from the
middle of the queue. Only when a block is taken for new content is its hash
dropped (eviction). The doubly linked list is hand-written because
collections.deque.remove is O(n) and OrderedDict cannot insert at the front.
"""

from __future__ import annotations

from typing import Callable, Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to confirm a hash hit (collision guard)
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; O(1) append, appendleft, popleft, remove."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        chain = [self._head, *blocks, self._tail]
        for prev, block in zip(chain, chain[1:]):  # linked in one pass: a pool has many blocks, built at start-up
            prev.next, block.prev = block, prev
        self.num_free = len(chain) - 2

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        block.prev, block.next = prev, nxt
        prev.next = nxt.prev = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next)

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise RuntimeError("no free KV block")
        block = self._head.next
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """Free block ids from least to most recently freed (for tests and debugging)."""
        ids, node = [], self._head.next
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[int], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding that content
        # Told the hash of each evicted cached block (hybrid models drop the state snapshot keyed by it).
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the LRU end, evicting their cached content. Caller checks num_free_blocks."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = block.token_ids = None

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's cache entry (its content was never computed); it stays allocated to its owner."""
        self._evict(block)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block holding exactly these tokens under this hash, or None (collision-safe)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, reviving free ones out of the middle of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Register a full, computed block under its hash (True if this registered it). An existing entry wins
        (first writer)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # same content computed twice (e.g. a race in one step); keep the first copy
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block
        return True

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail-first).

        Blocks without a hash go to the front of the queue (reused first); cached
        ones to the back, so the LRU order decides which cached content goes.
        """
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            block.block_hash = block.token_ids = None
        self.cached.clear()
