r"""KVCacheManager: each request's block table, prefix-cache lookups, check-before-commit allocation.

    request tokens:  [ block 0 ][ block 1 ][ block 2 ][ blo..]
    block table:        b12        b3         b40       b7
                     \______ shared with any request whose first ______/
                             24 tokens hash (chained) to the same values

Blocks are hashed when they become full *as of the end of the step that
computes them*. Because every layer writes the whole step's K/V before any of
its attention reads, a second request scheduled in the same step may already
hit those blocks: N requests arriving together compute their shared prefix once.

Hybrid models (recurrent state) also need the state after the prefix: with a
SnapshotPool a prefix hit ends at the last cached block that has a committed
state snapshot, and each prefill chunk asks for snapshots at the block
boundaries it passes (`plan_snapshots`). A snapshot is written while its step
runs, so unlike a KV block it cannot be shared within that step: a newcomer
whose prefix has a snapshot pending waits one step (`is_prefix_in_flight`).
"""

from __future__ import annotations

from collections import Counter

from pagellm.core.block_pool import BlockPool, KVBlock
from pagellm.core.snapshot_pool import SnapshotPool
from pagellm.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 snapshots: SnapshotPool | None = None, idle_budget: int | None = None,
                 snapshot_interval: int | None = None):
        """idle_budget: blocks no request holds that may stay resident, the prefix cache's budget (None: no
        limit); past it blocks are released (core/block_pool.py), and their snapshots with them.
        snapshot_interval: tokens between the state snapshots of a prompt (a multiple of block_size; None: every
        block), besides the one at its last full block."""
        self.block_size = block_size
        self.snapshot_interval = snapshot_interval or block_size
        if self.snapshot_interval % block_size:
            raise ValueError(f"state_snapshot_interval {self.snapshot_interval} is not a multiple of the block size "
                             f"{block_size}")
        self.enable_caching = enable_caching
        self.snapshots = snapshots if enable_caching else None  # hybrid models: state at block boundaries
        on_evict = self.snapshots.discard if self.snapshots is not None else None
        self.pool = BlockPool(num_blocks, enable_caching, on_evict, idle_budget)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # blocks of each request already registered in the cache
        # Hashes of full prompt blocks that a running request will compute in a later step:
        # a newcomer needing one of them waits a step instead of computing it again.
        self._in_flight: Counter[int] = Counter()
        self._registered: list[tuple[int, int]] = []  # (block id, hash) newly cached since take_registered
        self._in_flight_of: dict[str, list[int]] = {}

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request, and the tokens they hold.

        When all tokens hit the cache we must still recompute the last one to get
        its logits, so the hit is capped at num_tokens - 1 (rounded down to a block).
        With snapshots (hybrid models) the run is cut back to its last block that
        has a committed state snapshot: the state cannot resume anywhere else.
        """
        if not self._reads_cache(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, request.block_token_ids(i))
            if block is None:
                break
            hits.append(block)
        if self.snapshots is not None:
            while hits and self.restore_row(request, len(hits)) is None:
                hits.pop()
        return hits, len(hits) * self.block_size

    def restore_row(self, request: Request, num_cached_blocks: int) -> int | None:
        """Hybrid models: the snapshot row holding the state after the request's first blocks, if any."""
        if self.snapshots is None or num_cached_blocks == 0:
            return None
        return self.snapshots.lookup(request.block_hashes[num_cached_blocks - 1],
                                     num_cached_blocks * self.block_size)

    def is_prefix_in_flight(self, request: Request, num_cached_blocks: int) -> bool:
        """Whether another running request is computing the prefix beyond the request's cache hit.

        That is: its next uncached block is computed in a later step, or (hybrid models) a
        snapshot further along its prefix is being written in this step.
        """
        if not self._reads_cache(request) or num_cached_blocks >= len(request.block_hashes):
            return False
        if self._in_flight[request.block_hashes[num_cached_blocks]] > 0:
            return True
        if self.snapshots is None:
            return False
        max_blocks = (request.num_tokens - 1) // self.block_size
        return any(self.snapshots.is_pending(h) for h in request.block_hashes[num_cached_blocks:max_blocks])

    def plan_snapshots(self, request: Request, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """Pending snapshot rows for the boundaries p, start < p <= end, of the request's prompt: every
        snapshot_interval tokens, and its last full block (where a follow-up prompt that extends it, a chat's next
        turn, branches off).

        Returns ((p, row), ...) ascending. Boundaries that already have a snapshot are
        skipped. When rows run short the deepest boundaries win: they give the longest
        hits, and a chunked prompt then keeps its last boundaries.
        """
        if self.snapshots is None:
            return ()
        bs, every = self.block_size, self.snapshot_interval
        last = min(end, request.num_prompt_tokens) // every * every  # generated tokens get no snapshots
        boundaries = list(range(last, start, -every))
        prompt_end = request.num_prompt_tokens // bs * bs
        if start < prompt_end <= end and prompt_end % every:
            boundaries.insert(0, prompt_end)
        writes = []
        for p in boundaries:
            block_hash = request.block_hashes[p // bs - 1]
            if self.snapshots.contains(block_hash):
                continue
            row = self.snapshots.allocate(block_hash, p)
            if row is None:
                break
            writes.append((p, row))
        return tuple(reversed(writes))

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens (after any cached prefix), or None if they don't fit.

        Returns the blocks appended to the request's table. On None nothing has changed.
        """
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_fresh = max(0, total_blocks - len(held) - len(cached_blocks))
        num_revived = sum(1 for b in cached_blocks if b.ref_count == 0)  # they leave the free queue too
        if num_fresh + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_blocks)
        appended = list(cached_blocks) + self.pool.allocate(num_fresh)
        if request.request_id not in self.req_blocks:
            self.req_blocks[request.request_id] = held
            self._num_hashed[request.request_id] = 0
            self._mark_in_flight(request, len(cached_blocks))
        held.extend(appended)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return appended

    def cache_computed(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are computed and now known: a verify step computes its
        drafts' KV before they are accepted (hashed only then)."""
        if request.request_id in self.req_blocks:
            self._cache_full_blocks(request, request.num_computed_tokens)

    def _reads_cache(self, request: Request) -> bool:
        """Whether a request may start from cached blocks. One that asked for prompt_logprobs needs the
        logits of every prompt position, and an embedding request (pooling) their hidden states, so they compute
        them all (vLLM skips its prefix lookup too); the blocks they fill are still cached for others."""
        params = request.sampling_params
        return self.enable_caching and params.prompt_logprobs is None and params.pooling is None

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        rid, blocks = request.request_id, self.req_blocks[request.request_id]
        num_full = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        for i in range(self._num_hashed[rid], num_full):
            if self.pool.cache_block(blocks[i], request.block_hashes[i], request.block_token_ids(i)):
                self._registered.append((blocks[i].block_id, request.block_hashes[i]))
        self._num_hashed[rid] = max(self._num_hashed[rid], num_full)
        self._settle_in_flight(request, num_full)

    def _mark_in_flight(self, request: Request, first_block: int) -> None:
        if not self.enable_caching:
            return
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        pending = list(range(first_block, num_prompt_blocks))  # block indexes still to compute
        self._in_flight.update(request.block_hashes[i] for i in pending)
        self._in_flight_of[request.request_id] = pending

    def _settle_in_flight(self, request: Request, num_full: int) -> None:
        """Blocks below num_full are cached now: they are no longer in flight."""
        pending = self._in_flight_of.get(request.request_id)
        if not pending or pending[0] >= num_full:
            return
        done = [i for i in pending if i < num_full]
        self._in_flight.subtract(request.block_hashes[i] for i in done)
        self._in_flight_of[request.request_id] = pending[len(done):]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks, between runs). Refused (False) while a request holds blocks."""
        if self.req_blocks or (self.snapshots is not None and not self.snapshots.reset()):
            return False
        self.pool.reset_prefix_cache()
        return True

    def take_registered(self) -> tuple[tuple[int, int], ...]:
        """(block id, hash) of the blocks registered in the prefix cache since the last call: one step's."""
        registered, self._registered = tuple(self._registered), []
        return registered

    def take_released(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(KV block ids, snapshot rows) released since the last call: their pages may go back to the OS."""
        rows = self.snapshots.released.take() if self.snapshots is not None else ()
        return self.pool.released.take(), rows

    def release_warm(self) -> None:
        """The engine has nothing to run: the warm blocks (kept for reuse by busy steps) are released too."""
        self.pool.release_warm()

    def has_released(self) -> bool:
        """Whether pages wait to be released (an idle engine runs one step for them)."""
        return bool(self.pool.released) or (self.snapshots is not None and bool(self.snapshots.released))

    def forget(self, registered: tuple[tuple[int, int], ...]) -> None:
        """Unregister blocks a step registered (blocks are hashed as of the end of their step) when the step failed
        and never computed them: whoever holds them now, or none (a request aborted or preempted meanwhile)."""
        for block_id, block_hash in registered:
            block = self.pool.blocks[block_id]
            if block.block_hash == block_hash and self.pool.cached.get(block_hash) is block:
                self.pool.uncache(block)

    def free(self, request: Request) -> None:
        """Return a finished, aborted or preempted request's blocks, tail first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        pending = self._in_flight_of.pop(request.request_id, [])
        self._in_flight.subtract(request.block_hashes[i] for i in pending)
        self._in_flight = +self._in_flight  # drop zero counts so the map stays small
        self.pool.free(reversed(blocks))
