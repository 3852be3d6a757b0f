"""A peer engine of `pagellm bench compare` in a process of its own (the llama.cpp peer runs so).

Why: in pagellm's process a peer shares its heap (glibc's arenas, and the mmap threshold pagellm raises for its
step buffers), its page-fault history and its allocator state, so a peer's figures can move with what pagellm
did before: llama.cpp ran 6-14% faster beside pagellm's fp32 activations than beside bf16 ones in every pair,
whichever engine ran first (docs/benchmarks/2026-11-26-bf16-accuracy.md). Spawned, the peer has a fresh
interpreter and heap, as llama-batched-bench would. The engines still take turns, so each has every core while it
runs; times are taken inside the peer's process, the pipe's round trip outside them.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

_START_TIMEOUT = 300.0  # a peer's load: mapping a GGUF, importing its library
_RUN_TIMEOUT = 3600.0  # one workload; a hung peer must not hang the bench


class PeerProcess:
    """`make(*args)` built in a spawned process; its `run(*args)` and `description` served from there. `make`
    must be importable by name (a module-level class or function): the new interpreter imports it."""

    def __init__(self, make: Callable[..., Any], *args: Any):
        context = multiprocessing.get_context("spawn")  # not fork: a fork would start from pagellm's heap
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, make, args), name="bench peer", daemon=True)
        self._process.start()
        child.close()
        self.description = self._reply(_START_TIMEOUT)

    def run(self, *args: Any) -> Any:
        self._conn.send(("run", args))
        return self._reply(_RUN_TIMEOUT)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop", ()))
            except OSError:  # the pipe is gone already
                pass
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            self.close()
            raise RuntimeError(f"bench peer: no answer in {timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise RuntimeError(f"bench peer: its process ended (exit code {self._process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"bench peer: {value}")
        return value


def _serve(conn, make: Callable[..., Any], args: tuple) -> None:
    """The peer's process: build it, answer ("ok", description), then ("ok", result) per run until "stop"."""
    try:
        peer = make(*args)
    except Exception as exc:  # noqa: BLE001 - whatever stops the build is the parent's error to raise
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", peer.description))
    try:
        while True:
            kind, run_args = conn.recv()
            if kind != "run":
                break
            try:
                conn.send(("ok", peer.run(*run_args)))
            except Exception as exc:  # noqa: BLE001 - a failed run is reported; the peer serves the next
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except EOFError:  # the bench went away
        pass
    finally:
        close = getattr(peer, "close", None)
        if close is not None:
            close()
