"""The cyclic garbage collector through start-up: paused, and what start-up made frozen out of its reach.

No torch import here: the pause must begin before torch's.
"""

from __future__ import annotations

import atexit
import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The cyclic GC off for a stretch of start-up (the CLI's and server's imports, a model's load), and what
    the stretch made frozen after it. Why: start-up creates hundreds of thousands of long-lived objects, and
    every full pass over the growing heap frees next to nothing: ~0.4 s of a two-second `pagellm serve` start
    (measured with gc.callbacks). Merely pausing would move that cost to the first passes after it (a young
    generation holding everything made meanwhile); frozen, no pass scans them again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        freeze_alive()
        if was_enabled:
            gc.enable()


def freeze_alive() -> None:
    """Move every object alive now out of the GC's reach (gc.freeze), handed back at exit."""
    gc.freeze()
    atexit.unregister(_collect_frozen_at_exit)  # once per process, however many freezes
    atexit.register(_collect_frozen_at_exit)


def _collect_frozen_at_exit() -> None:
    """What gc.freeze() kept alive and has died since (Triton's IR objects among it) would otherwise still be
    alive when the interpreter finalizes, and nanobind reports every such object as a leak: hundreds of lines
    after a normal run. Collected first, it is freed like any garbage."""
    gc.unfreeze()
    gc.collect()
