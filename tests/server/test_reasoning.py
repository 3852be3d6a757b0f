"""A thinking model's answer split into reasoning_content and content (server/reasoning.py), whole and streamed."""

from __future__ import annotations

import random

import pytest

from pagellm.config import ModelConfig
from pagellm.server.protocol import ChatCompletionRequest
from pagellm.server.reasoning import ReasoningSplitter, opened_by_prompt, split
from pagellm.server.responses import ChatFormatter
from tests.server.test_protocol import _output, _Tokenizer, parse

CASES = [  # (answer, prompt left <think> open, reasoning, content)
    ("<think>I weigh it.</think>\n\nParis.", False, "I weigh it.", "\n\nParis."),
    ("I weigh it.</think>Paris.", True, "I weigh it.", "Paris."),
    ("Paris.", False, None, "Paris."),
    ("<think>still thinking when cut off", False, "still thinking when cut off", None),
    ("<thinking> is not the marker", False, None, "<thinking> is not the marker"),
    ("<", False, None, "<"),
    ("a < b </thi", True, "a < b </thi", None),
]


@pytest.mark.parametrize("answer, opened, reasoning, content", CASES)
def test_a_whole_answer_splits_at_the_markers(answer, opened, reasoning, content):
    assert split(answer, opened) == (reasoning, content)


@pytest.mark.parametrize("answer, opened, reasoning, content", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_add_up_to_the_whole_split_and_never_cut_a_marker(answer, opened, reasoning, content, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(0, 6)))) if len(answer) > 1 else []
    pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
    splitter = ReasoningSplitter(opened)
    deltas = [splitter.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(r for r, _ in deltas) == (reasoning or "")
    assert "".join(c for _, c in deltas) == (content or "")
    assert not any("<think>" in r + c or "</think>" in r + c for r, c in deltas)


def test_opened_by_prompt():
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_by_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not opened_by_prompt("<start_of_turn>model\n")


def test_chat_formatter_sends_reasoning_content_whole_and_as_deltas():
    request = parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "hi"}], "stream": true}')
    formatter = ChatFormatter("m", request, _Tokenizer(), opened_reasoning=False)
    texts = ["<thi", "nk>Hm", "m.</th", "ink>Yes", "."]
    deltas = []
    for i, new in enumerate(texts):
        chunk = formatter.chunk(0, _output("a", "", [5], i == len(texts) - 1, new_text=new), False)
        deltas.append(chunk["choices"][0]["delta"])
    assert deltas == [{}, {"reasoning_content": "Hm"}, {"reasoning_content": "m."}, {"content": "Yes"},
                      {"content": "."}]
    plain = ChatFormatter("m", request, _Tokenizer())  # a model that does not think: no split
    whole = _output("b", "<think>Hmm.</think>Yes.", [5], True)
    assert plain.response([whole], {})["choices"][0]["message"] == {"role": "assistant",
                                                                    "content": "<think>Hmm.</think>Yes."}
    message = formatter.response([whole], {})["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "Hmm.", "content": "Yes."}


def test_only_a_vocabulary_with_both_markers_thinks():
    from pagellm.loader.default_model import default_model_path
    from pagellm.loader.tokenizer import load_tokenizer
    from pagellm.server.reasoning import thinks

    gemma = load_tokenizer(default_model_path(), ModelConfig().cache_dir)
    assert gemma.token_id("<start_of_turn>") == 105 and gemma.token_id("<think>") is None
    assert not thinks(gemma) and not thinks(None)

    class Qwen:
        def token_id(self, token):
            return {"<think>": 151667, "</think>": 151668}.get(token)

    assert thinks(Qwen())
