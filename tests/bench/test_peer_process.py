"""A bench peer in a process of its own (bench/peer_process.py): what `bench compare` runs llama.cpp in, so the peer's
heap is not pagellm's. Results and errors come back; a dead or closed peer never hangs the bench."""

from __future__ import annotations

import os

import pytest

from pagellm.bench.peer_process import PeerProcess
from tests.bench.fake_peers import EchoPeer


def test_the_peer_runs_in_another_process_and_answers_each_run(tmp_path):
    mark = tmp_path / "closed"
    peer = PeerProcess(EchoPeer, "a", str(mark))
    try:
        assert peer.description == "echo peer a"
        pid, tokens, tg, unified = peer.run([[1, 2, 3], [4, 5, 6]], 7, True)
        assert pid != os.getpid() and (tokens, tg, unified) == (6, 7, True)
        assert peer.run([[1]], 2, False)[1:] == (1, 2, False)
    finally:
        peer.close()
    assert mark.exists()  # the peer's own close ran: llama.cpp frees its model there
    assert not peer._process.is_alive()


def test_a_peer_that_cannot_load_raises_its_error():
    with pytest.raises(RuntimeError, match="ValueError: cannot load 'refuse'"):
        PeerProcess(EchoPeer, "refuse")


def test_a_failed_run_raises_and_the_peer_serves_the_next():
    peer = PeerProcess(EchoPeer, "b")
    try:
        with pytest.raises(RuntimeError, match="tg must be >= 0, got -1"):
            peer.run([[1]], -1, True)
        assert peer.run([[1]], 1, True)[1:] == (1, 1, True)
    finally:
        peer.close()


def test_a_peer_process_that_dies_is_an_error_not_a_hang():
    peer = PeerProcess(EchoPeer, "c")
    with pytest.raises(RuntimeError, match="its process ended \\(exit code 3\\)"):
        peer.run([[1]], 99, True)
    peer.close()
