"""The request fields that ask for structured output, read into one StructuredOutputs (server/structured_fields.py)."""

from __future__ import annotations

import json

import pytest

from pagellm.sampling_params import SamplingParams, StructuredOutputs
from pagellm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from pagellm.server.structured_fields import compile_error
from tests.server.test_protocol import parse

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("field, value, expected", [
    ("response_format", {"type": "json_object"}, StructuredOutputs(json_object=True)),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
     StructuredOutputs(json=SCHEMA)),
    # not strict: OpenAI only asks the model to follow the schema; holding it to the schema is allowed too
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": False}},
     StructuredOutputs(json=SCHEMA)),
    ("guided_json", SCHEMA, StructuredOutputs(json=SCHEMA)),
    ("guided_json", json.dumps(SCHEMA), StructuredOutputs(json=SCHEMA)),
    ("guided_regex", "[a-z]+", StructuredOutputs(regex="[a-z]+")),
    ("guided_choice", ["yes", "no"], StructuredOutputs(choice=("yes", "no"))),
    ("guided_grammar", 'root ::= "a"', StructuredOutputs(grammar='root ::= "a"')),
    ("structured_outputs", {"json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ("structured_outputs", {"json_object": True}, StructuredOutputs(json_object=True)),
    ("structured_outputs", {"choice": ["a"], "regex": None}, StructuredOutputs(choice=("a",))),
])
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_form_reaches_the_sampling_params(model, field, value, expected):
    base = {"prompt": "x"} if model is CompletionRequest else CHAT
    request = parse(model, json.dumps({**base, field: value, "n": 2}))
    assert request.structured == (expected, field)
    assert all(request.sampling_params(8, None, child).structured_outputs == expected for child in range(2))
    assert request.unknown_fields() == []


def test_plain_text_asks_for_nothing():
    request = parse(CompletionRequest, json.dumps({"prompt": "x", "response_format": {"type": "text"}}))
    assert request.structured is None and request.sampling_params(8, None, 0).structured_outputs is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"lark": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_json": SCHEMA, "min_tokens": 3}, "min_tokens"),
])
def test_bad_forms_are_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse(CompletionRequest, json.dumps({"prompt": "x", **body})).sampling_params(8, None, 0)
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize("field, message, expected", [
    ("response_format", "structured_outputs.json does not compile: x",
     "response_format.json_schema.schema does not compile: x"),
    ("guided_regex", "structured_outputs.regex does not compile: x", "guided_regex does not compile: x"),
    ("structured_outputs", "structured_outputs.grammar does not compile: x",
     "structured_outputs.grammar does not compile: x"),
])
def test_compile_errors_speak_of_the_field_sent(field, message, expected):
    error = compile_error(ValueError(message), field)
    assert (error.message, error.param) == (expected, field)


def test_structured_outputs_rejects_min_tokens_and_needs_exactly_one_form():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(regex="a"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_structured_outputs_are_cache_keys_one_per_output():
    """The engine caches compiled grammars by StructuredOutputs (runner/grammar.py): one schema however it was
    sent finds the one entry; different outputs never share one."""
    reordered = {"properties": {"a": {"type": "integer"}}, "type": "object"}  # SCHEMA, its keys in another order
    assert list(reordered) != list(SCHEMA) and reordered == SCHEMA
    same = [StructuredOutputs(json=SCHEMA), StructuredOutputs(json=reordered),
            StructuredOutputs(json=json.dumps(reordered))]
    assert all(spec == same[0] and hash(spec) == hash(same[0]) for spec in same) and len(set(same)) == 1
    assert hash(StructuredOutputs(choice=["yes", "no"])) == hash(StructuredOutputs(choice=("yes", "no")))
    different = [StructuredOutputs(json=SCHEMA), StructuredOutputs(json={"type": "object"}),
                 StructuredOutputs(json_object=True), StructuredOutputs(regex="[a-z]+"),
                 StructuredOutputs(regex="[a-z]*"), StructuredOutputs(choice=("yes", "no")),
                 StructuredOutputs(choice=("no", "yes")), StructuredOutputs(grammar='root ::= "a"')]
    cache = {spec: i for i, spec in enumerate(different)}
    assert len(cache) == len(different)  # each its own entry
    assert cache[StructuredOutputs(json=json.dumps(reordered))] == 0  # found by an equal key built anew
    params = {SamplingParams(structured_outputs=spec) for spec in [*different, *same]}  # keys of their own too
    assert len(params) == len(different)
    assert SamplingParams(structured_outputs=same[1]) in params and SamplingParams() not in params
