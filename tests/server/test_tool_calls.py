"""Tool calls: tool_choice read into a grammar, calls parsed out of answers in each format, whole and streamed."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagellm.server.errors import APIError
from pagellm.server.tool_calls import (ToolCallStream, ToolChoice, check_tools, forced_grammar, parse_auto,
                                       parse_forced, parser_for_template)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_tool_choice_modes_and_their_grammars():
    tools, choice = check_tools([WEATHER, TIME], None)
    assert choice == ToolChoice("auto") and forced_grammar(tools, choice) is None
    assert check_tools(None, None)[1] == ToolChoice("none")
    _, named = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named == ToolChoice("named", "get_weather")
    assert json.loads(forced_grammar([WEATHER], named).json) == WEATHER["function"]["parameters"]
    _, required = check_tools([WEATHER, TIME], "required")
    schema = json.loads(forced_grammar([WEATHER, TIME], required).json)
    jsonschema.validate([{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "x"}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    one = json.loads(forced_grammar([WEATHER, TIME], required, parallel=False).json)  # parallel_tool_calls false
    jsonschema.validate([{"name": "get_time", "arguments": {}}], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}], one)


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([], "required", "tool_choice"),
    ([{"type": "function"}], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "tools"),
])
def test_bad_tools_and_choices_are_a_400_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as info:
        check_tools(tools, choice)
    assert info.value.param == param


def test_forced_answers_parse():
    assert calls_of(parse_forced('{"city": "Paris"}', ToolChoice("named", "get_weather"))) == [
        ("get_weather", {"city": "Paris"})]
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert calls_of(parse_forced(text, ToolChoice("required"))) == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert parse_forced('[{"name": "get_ti', ToolChoice("required")) == []  # cut short by max_tokens


ANSWERS = [  # (parser, answer, content left, calls)
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Oslo"}}</tool_call>', None, [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ("hermes", "It is sunny <tool_ca", "It is sunny <tool_ca", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}', None,
     [("get_weather", {"city": "Lima"})]),
    ("llama3_json", ' {"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("llama3_json", "The time is noon.", "The time is noon.", []),
    ("pythonic", '[get_weather(city="Kyiv"), get_time()]', None, [("get_weather", {"city": "Kyiv"}), ("get_time", {})]),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "No call needed.", "No call needed.", []),
]


@pytest.mark.parametrize("parser, answer, content, calls", ANSWERS)
def test_auto_answers_parse_in_each_format(parser, answer, content, calls):
    rest, parsed = parse_auto(answer, parser)
    assert (rest, calls_of(parsed)) == (content, calls)


@pytest.mark.parametrize("parser, answer, content, calls", ANSWERS)
@pytest.mark.parametrize("seed", range(4))
def test_streamed_answers_give_the_same_content_and_calls(parser, answer, content, calls, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(1, 8))))
    pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
    stream = ToolCallStream(ToolChoice("auto"), parser)
    streamed, got = "", []
    for i, piece in enumerate(pieces):
        text, new_calls = stream.feed(piece, final=i == len(pieces) - 1)
        assert "<tool_call>" not in text or not calls
        streamed += text
        got += new_calls
    assert calls_of(got) == calls
    assert streamed.strip() == (content or "").strip()


def test_a_forced_stream_sends_no_content():
    stream = ToolCallStream(ToolChoice("named", "get_weather"), "hermes")
    assert stream.feed('{"city": ', final=False) == ("", [])
    text, calls = stream.feed('"Paris"}', final=True)
    assert text == "" and calls_of(calls) == [("get_weather", {"city": "Paris"})]


def test_parser_from_the_template():
    assert parser_for_template("... <tool_call> ...") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert parser_for_template("<start_of_turn>model") == "pythonic"
