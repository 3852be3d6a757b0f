"""StatePool: slots of recurrent state for hybrid models, one per running request.

A slot stands for the conv state and the recurrent state of every
linear-attention layer (the tensors themselves live on the runner side, indexed
by slot). Unlike KV blocks, a request's state does not grow with its length:
it takes one slot when first scheduled and gives it back when it finishes, is
aborted or is preempted. Slots are budgeted apart from the KV pool; a request
that finds none free waits in the queue (never an error).
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not allocated")
        self._free.append(slot)
