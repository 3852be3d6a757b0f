"""DraftLength (core/speculative.py): a request's draft length follows the accepted lengths of its verify steps."""

from __future__ import annotations

from pagellm.config import SpeculativeConfig
from pagellm.core.speculative import DraftLength


def test_a_copied_passage_gets_the_longest_drafts_and_a_miss_shortens_them():
    lengths = DraftLength(SpeculativeConfig(num_speculative_tokens=16))
    for _ in range(6):
        lengths.record(16, 16)  # every draft accepted: a passage being copied
    assert lengths.next_k() == 16
    for _ in range(3):
        lengths.record(16, 2)  # the passage changes after two tokens each time
    assert 1 <= lengths.next_k() < 16


def test_drafts_that_are_never_accepted_stop_and_are_probed_again():
    lengths = DraftLength(SpeculativeConfig(num_speculative_tokens=8, draft_token_cost=0.05))
    for _ in range(12):
        lengths.record(max(lengths.next_k(), 1), 0)
    proposals = [lengths.next_k() for _ in range(16)]
    assert sorted(proposals) == [0] * 15 + [1]  # plain decodes, and every 16th one draft to measure again


def test_a_short_proposal_says_nothing_past_its_end():
    lengths = DraftLength(SpeculativeConfig(num_speculative_tokens=16))
    for _ in range(8):
        lengths.record(16, 16)
    for _ in range(8):
        lengths.record(2, 2)  # the lookup's text ran out after two drafts, both accepted
    assert lengths.next_k() == 16


def test_fixed_length_when_not_adaptive():
    lengths = DraftLength(SpeculativeConfig(num_speculative_tokens=5, adaptive=False))
    lengths.record(5, 0)
    assert lengths.next_k() == 5


def test_lookups_that_keep_missing_let_async_steps_launch_ahead_and_look_again_now_and_then():
    """may_propose is what async scheduling waits for: a request whose lookups found nothing 16 times in a row
    stops holding steps back, but lets one in 16 wait so that its lookup runs again; a hit holds them again."""
    lengths = DraftLength(SpeculativeConfig())
    assert lengths.may_propose()
    for _ in range(15):
        lengths.looked_up(False)
    assert lengths.may_propose()  # 15 misses: still worth waiting for
    lengths.looked_up(False)
    decisions = [lengths.may_propose() for _ in range(32)]
    assert decisions == ([False] * 15 + [True]) * 2
    lengths.looked_up(True)
    assert all(lengths.may_propose() for _ in range(5))
