"""POST /v1/responses (server/responses_api.py) through the official openai client: the same turn as chat, in the
Responses envelope, streamed as Responses events; its conversion of input items, and its 400s."""

from __future__ import annotations

import json

import pytest

from pagellm.server.errors import APIError
from pagellm.server.responses_api import chat_request

GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def _chat_text(client, messages, max_tokens=12, **extra) -> str:
    answer = client.chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, **extra)
    return answer.choices[0].message.content


def test_a_response_is_the_chat_turn_in_the_responses_envelope(client):
    response = client.responses.create(model="gemma-3-270m", input="Name three colours.", **GREEDY,
                                       service_tier="auto", prompt_cache_key="k", truncation="disabled",
                                       metadata={"who": "test"})  # asking nothing that changes the answer
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == _chat_text(client, [{"role": "user", "content": "Name three colours."}])
    (item,) = response.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                         "output_text")
    usage = response.usage
    assert usage.output_tokens >= 1 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert response.status in ("completed", "incomplete")


def test_instructions_and_input_items_are_the_system_and_user_turns(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
             {"role": "user", "content": "And of Spain?"}]
    response = client.responses.create(model="gemma-3-270m", input=items, instructions="Be brief.", **GREEDY)
    expected = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Capital of France?"},
                                   {"role": "assistant", "content": "Paris."},
                                   {"role": "user", "content": "And of Spain?"}])
    assert response.output_text == expected


def test_a_stream_sends_the_responses_events_in_order(client):
    with client.responses.stream(model="gemma-3-270m", input="Count: one, two,", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == client.responses.create(
        model="gemma-3-270m", input="Count: one, two,", **GREEDY).output_text
    assert final.usage.output_tokens >= 1


def test_the_output_token_limit_leaves_the_response_incomplete(client):
    response = client.responses.create(model="gemma-3-270m", input="Tell me a long story.", temperature=0.0,
                                       max_output_tokens=3, extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model="gemma-3-270m", input="A city as JSON.", temperature=0.0,
                                       max_output_tokens=24,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert set(json.loads(response.output_text)) == {"city"}


def test_a_forced_function_call_is_a_function_call_item_streamed_with_its_arguments(client):
    choice = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model="gemma-3-270m", input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice=choice, temperature=0.0, max_output_tokens=24)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"city"}
    with client.responses.stream(model="gemma-3-270m", input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice=choice, temperature=0.0, max_output_tokens=24) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments


def test_function_call_items_become_the_assistant_calls_and_tool_answers():
    items = [{"role": "user", "content": "Weather in Paris and Rome?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    _, chat = chat_request(json.dumps({"input": items, "tools": [WEATHER], "max_output_tokens": 5}).encode())
    messages = [m.as_template_dict() for m in chat.messages]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert (messages[2]["tool_call_id"], messages[2]["content"], messages[3]["content"]) == ("c1", "sunny", "rain")
    assert chat.template_tools[0]["function"]["name"] == "get_weather" and chat.max_tokens_field == "max_output_tokens"
    # `input += response.output` replays the model's text and its call as the one turn the model wrote
    replay = [{"role": "user", "content": "Weather?"}, {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "Let me check."}]}, items[1], items[3]]
    _, chat = chat_request(json.dumps({"input": replay, "tools": [WEATHER]}).encode())
    turns = [m.as_template_dict() for m in chat.messages]
    assert [m["role"] for m in turns] == ["user", "assistant", "tool"]
    assert turns[1]["content"] == "Let me check." and [c["id"] for c in turns[1]["tool_calls"]] == ["c1"]


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": "x", "store": True}, "store", "stores no responses"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "input[0].content[0]: image input is not supported by this model"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "'item_reference' are not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "unknown role 'robot'"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: Input should be greater"),
    ({"input": "x", "max_output_tokens": 2.5}, "max_output_tokens", "max_output_tokens must be an integer"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "top_logprobs is not supported"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata", "metadata.a must be a string"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "text.format must be"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice",
     "not among the tools"),
    ({}, "input", "input is required"),
    ({"input": "x", "background": True}, "background", "background is not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation is not supported"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "include is not supported"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation is not supported"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text", "verbosity is not supported"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning", "summary is not supported"),
])
def test_what_it_cannot_do_is_a_400_naming_the_field(http, body, param, words):
    answer = http.post("/v1/responses", json=body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and words in error["message"], error
    with pytest.raises(APIError) as raised:
        chat_request(json.dumps(body).encode())
    assert raised.value.param == param
