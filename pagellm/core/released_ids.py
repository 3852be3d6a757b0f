"""ReleasedIds: the ids (KV blocks, snapshot rows) freed since a step last took them, whose pages may go back."""

from __future__ import annotations


class ReleasedIds:
    """Collected by a pool as it releases, taken once a step: the step carries them to every rank's runner."""

    def __init__(self):
        self._ids: list[int] = []

    def add(self, item: int) -> None:
        self._ids.append(item)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def take(self) -> tuple[int, ...]:
        """The ids since the last call, ascending, each once. One listed may have been handed out again since;
        its new owner writes it in the step that carries the list, after the release."""
        if not self._ids:  # most steps: nothing released
            return ()
        taken, self._ids = tuple(sorted(set(self._ids))), []
        return taken
