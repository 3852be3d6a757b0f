"""Tool calling through `pagellm serve` and the openai client, on a tiny random-weight Qwen3 checkpoint whose chat
template takes tools (Hermes format): a forced call parses, its result goes back, the final answer streams."""

from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import openai
import pytest

from pagellm.server.openapi import ChatCompletion, ChatCompletionChunk
from tests.server.server_harness import BASE_ARGS, start_server, stop_with

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                               "unit": {"type": "string", "enum": ["C", "F"]}},
              "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_qwen3_with_the_embedded_tokenizer):
    """A tiny Qwen3 with the embedded model's tokenizer (262k ids) and a Hermes tools template
    (templates/hermes_tools.jinja), served: the checkpoint is the session's (tests/conftest.py)."""
    directory = tiny_qwen3_with_the_embedded_tokenizer
    server = start_server(["--model", str(directory), "--served-model-name", "m", *BASE_ARGS,
                           "--max-model-len", "1024"], tmp_path_factory.mktemp("serve-tools"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0,
                        http_client=httpx.Client(limits=httpx.Limits(keepalive_expiry=2.0), timeout=120))
    stop_with(server, signal.SIGINT)


def test_forced_call_then_the_tool_result_and_a_streamed_answer(client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=forced,
                                           temperature=1.0, seed=0, max_tokens=40)
    ChatCompletion.model_validate(first.model_dump(exclude_unset=True))
    choice = first.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)

    messages = [*QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=[WEATHER, TIME], stream=True,
                                                temperature=0, max_tokens=8):
        for delta_choice in chunk.choices:
            pieces.append(delta_choice.delta.content or "")
            finish = delta_choice.finish_reason or finish
    assert len([p for p in pieces if p]) > 1 and finish in ("stop", "length")


def test_required_calls_stream_as_tool_call_deltas(client):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER, TIME], stream=True,
                                                # seed 0: two calls from this random model within 120 tokens (the
                                                # array of calls goes on past them under some seeds)
                                                tool_choice="required", temperature=1.0, seed=0, max_tokens=120):
        ChatCompletionChunk.model_validate(chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    schemas = {"get_weather": PARAMETERS, "get_time": TIME["function"]["parameters"]}
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])


def test_tool_messages_reach_the_template(client):
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    tokens = httpx.post(base + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    text = httpx.post(base + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in text
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text


def test_bad_tool_requests_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="m", messages=[*QUESTION, {"role": "tool", "content": "x"}])


def test_tools_round_trip_through_the_responses_api(client):
    """A required call as a function_call item; its output sent back as items renders as chat's tool turn does."""
    tools = [{"type": "function", **WEATHER["function"]}]
    first = client.responses.create(model="m", input=QUESTION[0]["content"], tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40)  # one call: the grammar ends
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    items = [QUESTION[0], {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    second = client.responses.create(model="m", input=items, tools=tools, temperature=0, max_output_tokens=8)
    chat = client.chat.completions.create(model="m", tools=[WEATHER], temperature=0, max_tokens=8, messages=[
        QUESTION[0], {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}])
    # the same prompt, tool result included (the answers themselves may differ: a bf16 random model's near-ties
    # fall either way with the prefix cache's hits)
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.usage.output_tokens >= 1


def test_tools_round_trip_through_the_messages_api(client):
    """A tool_use block from a forced call; its tool_result sent back renders as chat's tool turn does."""
    import anthropic
    import httpx2

    claude = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0,
                                 http_client=httpx2.Client(limits=httpx2.Limits(keepalive_expiry=2.0), timeout=120))
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": PARAMETERS}]
    first = claude.messages.create(model="m", max_tokens=40, tools=tools, messages=[QUESTION[0]],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use"
    jsonschema.validate(use.input, PARAMETERS)
    turns = [QUESTION[0], {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                             "input": use.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "18 degrees and sunny"}]}]
    second = claude.messages.create(model="m", max_tokens=8, tools=tools, messages=turns,
                                    extra_body={"temperature": 0.0})
    assert second.usage.input_tokens == claude.messages.count_tokens(model="m", tools=tools, messages=turns).input_tokens
    chat = client.chat.completions.create(model="m", tools=[WEATHER], temperature=0, max_tokens=8, messages=[
        QUESTION[0], {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees and sunny"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.stop_reason in ("end_turn", "max_tokens") and second.usage.output_tokens >= 1
