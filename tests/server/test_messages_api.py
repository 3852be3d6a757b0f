"""POST /v1/messages and /v1/messages/count_tokens (server/messages_api.py) through the official anthropic client:
the same turn as chat, as content blocks and Anthropic's stream events; its conversion of blocks, and its 400s in
Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx2
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagellm.server.error_answers import add_error_handlers
from pagellm.server.guards import ApiKeyMiddleware
from pagellm.server.messages_api import chat_request

MODEL = "gemma-3-270m"
GREEDY = {"temperature": 0.0}  # the current client has no temperature argument; older clients and raw HTTP send it
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server):
    # the client's own httpx2: idle connections dropped before the server's 5 s keep-alive closes them (conftest)
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               http_client=httpx2.Client(limits=httpx2.Limits(keepalive_expiry=2.0), timeout=120))


def _chat_text(client, messages, max_tokens=12, **extra) -> str:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                            **extra)
    return answer.choices[0].message.content


def test_a_message_is_the_chat_turn_as_content_blocks(claude, client):
    message = claude.messages.create(model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
                                     metadata={"user_id": "u1"}, service_tier="auto",  # no effect on the answer
                                     messages=[{"role": "user", "content": "Name three colours."}])
    expected = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Name three colours."}])
    assert (message.type, message.role, message.id[:4]) == ("message", "assistant", "msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == expected
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens >= 1
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.",
                                           messages=[{"role": "user", "content": "Name three colours."}])
    assert counted.input_tokens == message.usage.input_tokens


def test_system_blocks_and_text_blocks_are_the_same_turn(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=8, system="Be brief.", extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Capital of France?"}])
    blocks = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                    system=[{"type": "text", "text": "Be brief."}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": "Capital of "
                                                                            "France?"}]}])
    assert blocks.content[0].text == plain.content[0].text


def test_a_stream_sends_anthropics_events_and_the_same_text(claude):
    request = dict(model=MODEL, max_tokens=12, extra_body=GREEDY,
                   messages=[{"role": "user", "content": "Count: 1, 2,"}])
    with claude.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "thinking", "input_json")]  # the helper's own
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == claude.messages.create(**request).content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1


def test_a_stop_sequence_ends_the_turn_and_is_named(claude):
    request = dict(model=MODEL, max_tokens=16, extra_body=GREEDY,
                   messages=[{"role": "user", "content": "Describe Paris."}])
    text = claude.messages.create(**request).content[0].text
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text)) if text[i:i + 3].strip() == text[i:i + 3])
    stopped = claude.messages.create(**request, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]
    limited = claude.messages.create(**{**request, "max_tokens": 2, "extra_body": {**GREEDY, "ignore_eos": True}})
    assert (limited.stop_reason, limited.usage.output_tokens) == ("max_tokens", 2)


def test_a_forced_tool_is_a_tool_use_block_streamed_as_input_json(claude):
    request = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"},
                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    message = claude.messages.create(**request)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city"} and message.stop_reason == "tool_use"
    with claude.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == call.input and final.stop_reason == "tool_use"


def test_output_config_format_constrains_the_output_to_the_schema(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    message = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     messages=[{"role": "user", "content": "A city as JSON."}])
    assert set(json.loads(message.content[0].text)) == {"city"}


def test_a_request_failing_mid_stream_ends_with_anthropics_error_event():
    """The client raises on a named error event; an unnamed OpenAI-shaped one it would skip, ending the answer
    short as if it were whole."""
    import asyncio

    from pagellm.server.async_engine import RequestFailedError
    from pagellm.server.messages_api import MessagesFormatter
    from pagellm.server.streaming import sse

    class FailingStream:
        request_ids = ["r"]

        def __aiter__(self):
            return self

        async def __anext__(self):
            raise RequestFailedError("the row's grammar refused a token")

        def abort(self):
            pass

    async def events():
        return [e async for e in sse(FailingStream(), MessagesFormatter(MODEL, None, 3, None), [3], 1, True)]

    sent = [e for e in asyncio.run(events()) if e]
    assert sent[0].startswith("event: message_start") and sent[-1].startswith("event: error\n")
    payload = json.loads(sent[-1].split("data: ", 1)[1])
    assert payload == {"type": "error", "error": {"type": "api_error", "message": "the row's grammar refused a token"}}


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    body = {"max_tokens": 5, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "Thanks."}]}]}
    chat = chat_request(json.dumps(body).encode())
    messages = [m.as_template_dict() for m in chat.messages]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["content"] == "Let me look."
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert (messages[2]["tool_call_id"], messages[2]["content"], messages[3]["content"]) == ("t1", "sunny", "Thanks.")
    assert chat.template_tools[0]["function"]["parameters"] == WEATHER["input_schema"]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", "max_tokens is required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "greater than or equal"),
    ({"max_tokens": None, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "null is not accepted"),
    ({"max_tokens": 4.5, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "must be an integer"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]", "messages[0].content[0]: image input is not supported by this model"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role",
     "unknown role 'system' (user, assistant)"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "metadata": "x"}, "metadata",
     "metadata must be an object"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "service_tier": 1}, "service_tier",
     "'auto' or 'standard_only'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                   "name": "web_search"}]},
     "tools", "server tools are not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice", "not among the tools"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"}, "stop_sequences",
     "stop_sequences must be a list"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "x"}}},
     "output_config", "output_config.format must be"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]},
     "mcp_servers", "mcp_servers is not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "always"}},
     "thinking", "thinking.type must be"),
])
def test_what_it_cannot_do_is_a_400_in_anthropics_shape(http, body, param, words):
    answer = http.post("/v1/messages", json={"model": MODEL, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "error"
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def _errors_app(keys: tuple[str, ...] = ()) -> TestClient:
    """The server's error handlers and key check around a /v1/messages route that fails and an OpenAI one."""
    app = FastAPI()
    add_error_handlers(app)

    @app.post("/v1/messages")
    async def failing_messages():
        raise RuntimeError("boom")

    @app.post("/v1/completions")
    async def completions():
        return {}

    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("method, path, keys, status, kind", [
    ("post", "/v1/messages", ("k",), 401, "authentication_error"),  # the key check, before any route
    ("get", "/v1/messages", (), 405, "invalid_request_error"),
    ("post", "/v1/messages/nope", (), 404, "not_found_error"),
    ("post", "/v1/messages", (), 500, "api_error"),
])
def test_every_error_under_messages_is_in_anthropics_shape(method, path, keys, status, kind):
    answer = _errors_app(keys).request(method.upper(), path, json={})
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body


@pytest.mark.parametrize("method, path, keys, status", [
    ("post", "/v1/completions", ("k",), 401), ("get", "/v1/completions", (), 405), ("post", "/v1/nope", (), 404),
    ("post", "/v1/messagesx", (), 404)])
def test_errors_elsewhere_stay_in_openais_shape(method, path, keys, status):
    answer = _errors_app(keys).request(method.upper(), path, json={})
    assert answer.status_code == status, answer.text
    assert set(answer.json()) == {"error"} and answer.json()["error"]["message"], answer.json()
