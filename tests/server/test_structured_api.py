"""Structured output through `pagellm serve` and the official openai client: JSON that matches its schema for
seeded requests at temperature 1, streamed and not, n=2; bad schemas are a 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

MODEL = "gemma-3-270m"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {"type": "array", "items": {"type": "string", "enum": ["tea", "cats", "rain", "maths"]},
                  "maxItems": 3},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "likes", "retired"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Invent a person and describe them in JSON."}]


def chat(client, seed: int, stream: bool) -> list[str]:
    """The n=2 answers of one seeded request at temperature 1."""
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, n=2, max_tokens=96,
                  response_format=RESPONSE_FORMAT)
    if not stream:
        response = client.chat.completions.create(**kwargs)
        assert all(c.finish_reason == "stop" for c in response.choices)
        return [c.message.content for c in sorted(response.choices, key=lambda c: c.index)]
    texts, finishes = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"]
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_twenty_seeded_requests_give_json_matching_the_schema(client, stream):
    with ThreadPoolExecutor(20) as pool:  # at once: they batch in the engine
        answers = list(pool.map(lambda seed: chat(client, seed, stream), range(20)))
    texts = [text for pair in answers for text in pair]
    assert len(texts) == 40
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10  # sampled, not one answer repeated


def test_completions_with_vllm_fields(client):
    regex = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=1.0, seed=1,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text)
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, n=1)
    assert choice.choices[0].text in ("yes", "no")
    obj = client.completions.create(model=MODEL, prompt='Answer in JSON with one key "answer". 2+2?', max_tokens=40,
                                    temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(http, body, param):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "compile" in error["message"] or param == "ignore_eos", error


def test_a_bad_schema_is_an_openai_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


def test_tools_on_a_template_that_does_not_take_them_are_a_400(http):
    """The embedded Gemma's template has no tools: calling them 'auto' would silently drop them from the prompt."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": [tool]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
    forced = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "tools": [tool], "max_tokens": 8,
        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert forced.status_code == 200 and forced.json()["choices"][0]["message"]["tool_calls"][0]["function"][
        "name"] == "f"
