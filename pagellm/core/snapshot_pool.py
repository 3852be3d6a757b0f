r"""SnapshotPool: recurrent-state snapshots at KV block boundaries, the state half of the prefix cache.

A hybrid model's KV prefix hit is only usable if the recurrent state after the
same prefix can be restored too. So while a request's prompt is prefilled, the
state at given block boundaries (every state_snapshot_interval tokens, and the
prompt's last full block: KVCacheManager.plan_snapshots) is copied into a
snapshot row, keyed by the chained hash of the block that ends there (the hash
names the whole prefix); with 4-token blocks and an interval of 4:

    prompt:      [ blk 0 ][ blk 1 ][ blk 2 ][ bl..]
    snapshots:           ^ H(b0)  ^ H(b1)  ^ H(b2)     state after 4, 8, 12 tokens

Rows are extra rows of the runner's per-layer state tensors, after the running
slots (`first_row` on): the scheduler hands the runner row numbers, never data.

A row is in one of three states:
    free     no content; reused first
    pending  allocated this step for a boundary the step will pass; written while
             the model runs, so nobody may restore it before `commit` (after the step)
    cached   holds a snapshot; on the LRU list while no pending restore references it
New rows come from the free list, then from the least recently used cached row
(eviction). Like KV blocks, a row referenced by this step (pending, or the source
of a restore) is never evicted.

A row's pages become resident when a step first writes it, so resident snapshots
never pass the pool's budget (state_snapshot_memory). A row that loses its
snapshot without being reused (its KV block evicted or released, a cancelled
write, a reset) goes back to the free list and is released: its pages return
to the operating system, as a released KV block's do (`released`).
"""

from __future__ import annotations

from collections import OrderedDict

from pagellm.core.released_ids import ReleasedIds


class SnapshotPool:
    def __init__(self, num_rows: int, first_row: int = 0):
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.num_rows = num_rows
        self.first_row = first_row
        self._free = list(range(first_row + num_rows - 1, first_row - 1, -1))  # pop() hands out first_row first
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached rows, least recent first
        self._refs: dict[int, int] = {}  # referenced rows: pending writes and restore sources this step
        self._pending: set[int] = set()
        self._key_of: dict[int, tuple[int, int]] = {}  # row -> (block hash, tokens before the boundary)
        self._row_of: dict[int, int] = {}  # block hash -> row
        self.released = ReleasedIds()  # rows freed without reuse: their pages may go back

    # ---- counters -------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        """Rows referenced right now (pending writes, restore sources); 0 between steps."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Rows holding a usable snapshot."""
        return len(self._row_of) - len(self._pending)

    @property
    def num_available(self) -> int:
        """Rows `allocate` can still hand out (free, or cached and evictable)."""
        return len(self._free) + len(self._lru)

    # ---- lookups ----------------------------------------------------------------------------

    def lookup(self, block_hash: int, num_tokens: int) -> int | None:
        """Row of the committed snapshot after `num_tokens` tokens under this hash, or None.

        The token count is a cheap guard: a chained-hash collision would also have
        to land on the same boundary (the KV lookup already compared the tokens).
        """
        row = self._row_of.get(block_hash)
        if row is None or row in self._pending or self._key_of[row][1] != num_tokens:
            return None
        return row

    def is_pending(self, block_hash: int) -> bool:
        row = self._row_of.get(block_hash)
        return row is not None and row in self._pending

    def contains(self, block_hash: int) -> bool:
        """Committed or being written this step: no second copy is needed."""
        return block_hash in self._row_of

    # ---- life cycle -------------------------------------------------------------------------

    def allocate(self, block_hash: int, num_tokens: int) -> int | None:
        """A pending row for the snapshot after `num_tokens` tokens, or None when every row is referenced."""
        if block_hash in self._row_of:
            raise ValueError(f"a snapshot for block hash {block_hash} already exists")
        if self._free:
            row = self._free.pop()
        elif self._lru:
            row, _ = self._lru.popitem(last=False)
            self._unregister(row)  # eviction
        else:
            return None
        self._key_of[row], self._row_of[block_hash] = (block_hash, num_tokens), row
        self._pending.add(row)
        self._refs[row] = 1
        return row

    def commit(self, row: int) -> None:
        """The step that wrote this pending row has run: it may be restored from now on."""
        if row not in self._pending:
            raise ValueError(f"snapshot row {row} is not pending")
        self._pending.discard(row)
        self.release(row)

    def cancel(self, row: int) -> None:
        """A pending row whose step will not run for its request (preempted while scheduling)."""
        if row not in self._pending:
            raise ValueError(f"snapshot row {row} is not pending")
        self._pending.discard(row)
        del self._refs[row]
        self._unregister(row)
        self._drop_row(row)

    def acquire(self, row: int) -> None:
        """Pin a committed row as the source of a restore in this step (not evictable until released)."""
        if row in self._pending or row not in self._key_of:
            raise ValueError(f"snapshot row {row} holds no committed snapshot")
        self._lru.pop(row, None)
        self._refs[row] = self._refs.get(row, 0) + 1

    def release(self, row: int) -> None:
        count = self._refs.get(row, 0) - 1
        if count < 0:
            raise RuntimeError(f"snapshot row {row} released more often than taken")
        if count:
            self._refs[row] = count
            return
        del self._refs[row]
        if row in self._key_of:
            self._lru[row] = None  # most recently used end
        else:
            self._drop_row(row)

    def discard(self, block_hash: int) -> None:
        """The KV block under this hash was evicted: without it the snapshot can never hit, so free its row.

        A referenced row is left alone (it is in use this step; the LRU ages it out later).
        """
        row = self._row_of.get(block_hash)
        if row is None or row in self._refs:
            return
        del self._lru[row]
        self._unregister(row)
        self._drop_row(row)

    def reset(self) -> bool:
        """Forget every snapshot (with the KV prefix cache). Refused (False) while a row is referenced."""
        if self._refs:
            return False
        for row in list(self._lru):
            self._unregister(row)
            self._drop_row(row)
        self._lru.clear()
        return True

    def _drop_row(self, row: int) -> None:
        """A row without a snapshot: free, and its pages to be released."""
        self._free.append(row)
        self.released.add(row)

    def _unregister(self, row: int) -> None:
        block_hash, _ = self._key_of.pop(row)
        if self._row_of.get(block_hash) == row:
            del self._row_of[block_hash]
