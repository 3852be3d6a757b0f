"""BlockPool: the KV blocks, their reference counts, the free blocks in the order they are reused, and the
prefix-hash map.

A free block (ref_count 0) is in one of three places, taken from in this order:

    warm    resident, holds nothing (a finished request's last, partial block; a forgotten prefix):
            reused first, the most recently freed first (its pages are hottest)
    cold    not resident: never written, or released (its pages handed back to the operating system)
    cached  resident, holds a prefix under its hash: an LRU queue a later request can revive a block from in
            O(1); evicted, least recently freed first, only when neither of the others has a block

                                               hash -> block map
    warm:   [b4, b8]  (deque)                  H(b3) -> b3, H(b9) -> b9
    cold:   [b12, b11, b10]  (stack)           (a cached block keeps its hash until it is evicted, or released)
    cached: head <-> b3 <-> b9 <-> tail

Resident memory so follows the work: the pool's never-written blocks stay untouched while any freed one can
serve. The cached blocks have a budget (`idle_budget`, the prefix cache's): past it the least recently used lose
their hash and turn warm. Warm blocks are what a busy engine reuses without faulting pages in again; there may be
as many as the budget, past it (and all of them once the engine is idle, `release_warm`) they are released: each
goes to cold, and its id to the released list, which the runner turns into MADV_DONTNEED on the block's pages
(runner/host_pages.py). So resident blocks are the live ones plus at most twice the budget while steps run, and
at most the budget when idle. Without a budget nothing is released: vLLM's order. The doubly linked list is
hand-written because collections.deque.remove is O(n) and OrderedDict cannot insert at the front.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from pagellm.core.released_ids import ReleasedIds


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
    """Doubly linked list of free blocks with sentinels; O(1) append, popleft and removal from the middle."""

    def __init__(self):
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        block.prev, block.next = prev, nxt
        prev.next = nxt.prev = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev, self._tail)

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
                 on_evict: Callable[[int], None] | None = None, idle_budget: int | None = None):
        """idle_budget: how many free blocks may stay resident for their cached prefix, and how many more, warm,
        while the engine is busy (None: no limit, nothing is released)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if idle_budget is not None and idle_budget < 0:
            raise ValueError(f"idle_budget must be >= 0 blocks, got {idle_budget}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.idle_budget = idle_budget
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.warm: deque[KVBlock] = deque()  # newest at the right: reused from there, released from the left
        self.cold: list[KVBlock] = self.blocks[::-1]  # pop() hands out block 0 first
        self.cached_queue = FreeBlockQueue()  # free blocks holding a hash, least recently freed first
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding that content
        # Told the hash of each evicted cached block (hybrid models drop the state snapshot keyed by it).
        self.on_evict = on_evict
        self.released = ReleasedIds()  # ids whose pages are to go back, taken by each step
        self.num_released_total = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.warm) + len(self.cold) + self.cached_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_resident_blocks(self) -> int:
        """Blocks whose pages are (or are about to be) written: all but the cold ones."""
        return self.num_blocks - len(self.cold)

    @property
    def num_idle_resident_blocks(self) -> int:
        """Resident blocks no request holds: cached and warm."""
        return len(self.warm) + self.cached_queue.num_free

    @property
    def num_idle_cached_blocks(self) -> int:
        """Free blocks kept resident for the prefix they hold."""
        return self.cached_queue.num_free

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order allocate takes them (for tests and debugging)."""
        return ([b.block_id for b in reversed(self.warm)] + [b.block_id for b in reversed(self.cold)]
                + self.cached_queue.block_ids())

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks: warm, then cold, then the LRU cached ones (evicted). Caller checks num_free_blocks."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            if self.warm:
                block = self.warm.pop()
            elif self.cold:
                block = self.cold.pop()
            else:
                block = self.cached_queue.popleft()
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
        """Drop a block's cache entry (its content was never computed); a free one turns warm, a held one stays
        with its owner."""
        if block.ref_count == 0 and block.block_hash is not None:
            self.cached_queue.remove(block)
            self.warm.append(block)
        self._evict(block)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block holding exactly these tokens under this hash, or None (collision-safe)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, reviving free ones out of the middle of the cached queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.cached_queue.remove(block)
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

        Blocks without a hash turn warm (reused first); cached ones go to the back of the cached queue, so
        the LRU order decides which cached content goes. Then both are trimmed to the budget.
        """
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.warm.append(block)
                else:
                    self.cached_queue.append(block)
        self._trim()

    def _trim(self) -> None:
        """Hold the cached blocks to the budget (past it the least recently used lose their hash and turn warm),
        and the warm ones to as many again (past it the oldest are released)."""
        if self.idle_budget is None:
            return
        while self.cached_queue.num_free > self.idle_budget:
            block = self.cached_queue.popleft()
            self._evict(block)
            self.warm.append(block)
        while len(self.warm) > self.idle_budget:
            self._release(self.warm.popleft())

    def release_warm(self) -> None:
        """Release every warm block (an engine with nothing to run: the next request may be far off). Under a
        budget only: without one nothing is ever released."""
        if self.idle_budget is not None:
            while self.warm:
                self._release(self.warm.popleft())

    def _release(self, block: KVBlock) -> None:
        self.cold.append(block)
        self.released.add(block.block_id)
        self.num_released_total += 1

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self.uncache(block)
