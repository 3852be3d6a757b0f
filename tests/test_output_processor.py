"""Stop strings found in the streamed text (output_processor.RequestState) as a search of the whole text finds them."""

from __future__ import annotations

import pytest
import torch

from pagellm.config import ModelConfig
from pagellm.loader.default_model import default_model_path
from pagellm.loader.tokenizer import load_tokenizer
from pagellm.output_processor import RequestState
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. 日本語 🙂 ok"


@pytest.fixture(scope="module")
def gemma():
    return load_tokenizer(default_model_path(), ModelConfig().cache_dir)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_match_as_a_whole_text_search(gemma, seed):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(TEXT) - 12, (3,), generator=g).tolist()
    stops = [TEXT[i:i + int(n)] for i, n in zip(starts, torch.randint(1, 12, (3,), generator=g).tolist())]
    stops.append("never in the text")
    ids = gemma.encode(TEXT, add_special_tokens=False)
    state = RequestState(Request("r", [2], SamplingParams(stop=stops), 16), None, gemma)
    status = None
    for token_id in ids:
        status = state.add_token(token_id, None)
        if status is not None:
            break
    index, stop = _first_stop(TEXT, stops)
    assert status is RequestStatus.FINISHED_STOPPED and state.stop_reason == stop
    assert state.text == TEXT[:index]


def test_stop_lists_are_bounded_in_count_and_length():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS + [])
    SamplingParams(stop="y" * MAX_STOP_LENGTH)
    with pytest.raises(ValueError, match=f"stop must hold at most {MAX_STOP_STRINGS} strings, got 20000"):
        SamplingParams(stop=["x"] * 20_000)
    with pytest.raises(ValueError, match=f"stop strings must be at most {MAX_STOP_LENGTH} characters"):
        SamplingParams(stop=["a", "y" * (MAX_STOP_LENGTH + 1)])
