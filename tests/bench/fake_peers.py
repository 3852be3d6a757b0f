"""Peers for tests/bench/test_peer_process.py: importable by name, light, so a spawned process loads them fast."""

from __future__ import annotations

import os


class EchoPeer:
    """Answers with its process id and what it was given; fails on request; `close` leaves a mark."""

    def __init__(self, tag: str, closed_mark: str | None = None):
        if tag == "refuse":
            raise ValueError("cannot load 'refuse'")
        self.description = f"echo peer {tag}"
        self.closed_mark = closed_mark

    def run(self, prompts: list[list[int]], tg: int, unified: bool):
        if tg < 0:
            raise ValueError(f"tg must be >= 0, got {tg}")
        if tg == 99:
            os._exit(3)  # the process dies mid-run
        return os.getpid(), sum(map(len, prompts)), tg, unified

    def close(self) -> None:
        if self.closed_mark:
            open(self.closed_mark, "w").close()
