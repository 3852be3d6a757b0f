"""Errors that point at the part (issue 56): a conversation's parts in Chat Completions, the Responses API and the
Messages API; counts with their units; the client's own field names; integers sent as whole-number floats; wrongly
typed fields refused. Parsing alone, no model, except where the route's own check is the point (`http`)."""

from __future__ import annotations

import json

import pytest

from pagellm.server import messages_api, responses_api
from pagellm.server.embeddings import EmbeddingRequest
from pagellm.server.errors import APIError
from pagellm.server.infill import completion_request
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, parse_request
from pagellm.server.request_limits import check_capacity, max_tokens

USER = {"role": "user", "content": "x"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}


def chat(body: dict):
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def refused(parse, body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("messages, param, message", [
    ([USER, USER, {"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]}], "messages[2].content[1]",
     "messages[2].content[1]: image input is not supported by this model"),
    ([{"role": "robot", "content": "x"}], "messages[0].role",
     "messages[0].role: unknown role 'robot' (system, user, assistant, tool, developer)"),
    ([{"role": "r" * 5000, "content": "x"}], "messages[0].role", "(4936 more characters)"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content", "got an object"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]",
     "audio input is not supported"),
    ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "messages[0].content[0]",
     "file input is not supported"),
    ([{"role": "user", "content": [{"type": "hologram"}]}], "messages[0].content[0]",
     "content parts of type 'hologram' are not supported (text)"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text", "must be a string"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]", "got a string"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id", "tool_call_id is required"),
    (["x"], "messages[0]", "messages[0] must be a message object"),
    ([], "messages", "non-empty list"),
])
def test_chat_message_errors_point_at_the_part(messages, param, message):
    error = refused(chat, {"messages": messages})
    assert error.param == param and message in error.message, error.message
    assert error.body()["error"]["param"] == param


def test_an_assistant_message_that_only_calls_needs_no_content():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    request = chat({"messages": [USER, {"role": "assistant", "tool_calls": calls}, {"role": "tool",
                                                                                      "tool_call_id": "c1",
                                                                                      "content": "1"}]})
    assert request.messages[1].as_template_dict()["content"] == ""


def test_null_or_missing_content_is_empty_text_on_every_role():
    """As vLLM and llama-server take it: a reply pagellm itself gave with null content (it only thought) is sent
    back as history on the next turn."""
    request = chat({"messages": [{"role": "system", "content": None}, USER, {"role": "assistant", "content": None},
                                 {"role": "tool", "tool_call_id": "c"}, {"role": "user"}]})
    assert [m.as_template_dict()["content"] for m in request.messages] == ["", "x", "", "", ""]


@pytest.mark.parametrize("body, param, message", [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image"}]}]},
     "input[0].content[1]", "input[0].content[1]: image input is not supported by this model"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]",
     "file input is not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "unknown role 'robot' (user, assistant"),
    ({"input": [USER, {"role": "user"}]}, "input[1].content", "input[1].content is required"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name", "is required"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output",
     "got a number"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]", "input items of type 'web_search_call'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "at least one message"),
])
def test_responses_input_errors_point_at_the_part(body, param, message):
    error = refused(lambda b: responses_api.chat_request(json.dumps(b).encode()), body)
    assert error.param == param and message in error.message, error.message


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [USER, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image",
                                                                                      "source": {}}]}]},
     "messages[1].content[1]", "messages[1].content[1]: image input is not supported by this model"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]",
     "document input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0]", "image input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]", "tool_use blocks belong in assistant messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 1}]}]},
     "messages[0].content[0].input", "must be an object"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "top-level system field"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content is required"),
    ({"messages": [USER], "system": [{"type": "text", "text": "a"}, {"type": "image"}]}, "system[1]",
     "system[1]: image input"),
    ({"messages": []}, "messages", "at least one message"),
])
def test_messages_api_errors_point_at_the_part(body, param, message):
    error = refused(lambda b: messages_api.chat_request(json.dumps({"max_tokens": 4, **b}).encode()), body)
    assert error.param == param and message in error.message, error.message


def test_errors_past_parsing_name_the_outer_part_and_field():
    """The template, the context check and the engine speak of chat's messages and max_completion_tokens: a
    converted request puts them in the outer API's words (chat message i -> the part it came from)."""
    body = {"system": "s", "max_tokens": 4, "messages": [USER, {"role": "assistant", "content": "a"}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"},
                                    {"type": "text", "text": "t"}]}]}
    converted = messages_api.chat_request(json.dumps(body).encode())
    error = converted.in_outer_words(APIError("messages[3]: bad; messages[4] too", "messages[3]"))
    assert (error.message, error.param) == ("messages[2].content[0]: bad; messages[2] too", "messages[2].content[0]")
    _, converted = responses_api.chat_request(json.dumps({"instructions": "i", "input": [USER]}).encode())
    error = converted.in_outer_words(APIError("messages[1].content: x; max_completion_tokens asks for 9 more; the "
                                              "prompt (messages) has", "max_completion_tokens"))
    assert error.message == "input[0].content: x; max_output_tokens asks for 9 more; the prompt (input) has"
    assert error.param == "max_output_tokens"


@pytest.mark.parametrize("parse, body, field, value, sent_as", [
    (chat, {"messages": [USER], "max_tokens": 1851.0}, "max_tokens", 1851, "max_tokens"),
    (chat, {"messages": [USER], "n": 2.0, "seed": -3.0, "top_logprobs": 2.0, "logprobs": True}, "seed", -3, "seed"),
    (lambda b: parse_request(json.dumps(b).encode(), CompletionRequest), {"prompt": [1.0, 2.0]}, "prompt",
     [1, 2], "prompt"),
    (lambda b: parse_request(json.dumps(b).encode(), DetokenizeRequest), {"tokens": [3.0]}, "tokens", [3],
     "tokens"),
    (lambda b: parse_request(json.dumps(b).encode(), EmbeddingRequest), {"input": "x", "dimensions": 8.0},
     "dimensions", 8, "dimensions"),
    (lambda b: messages_api.chat_request(json.dumps(b).encode()), {"messages": [USER], "max_tokens": 1851.0},
     "max_tokens", 1851, "max_tokens"),
    (lambda b: responses_api.chat_request(json.dumps(b).encode())[0], {"input": "x", "max_output_tokens": 7.0},
     "max_output_tokens", 7, "max_output_tokens"),
    (lambda b: completion_request(json.dumps(b).encode())[1], {"input_prefix": "a", "input_suffix": "b",
                                                               "n_predict": 5.0}, "max_tokens", 5, "n_predict"),
])
def test_a_whole_number_float_is_that_integer(parse, body, field, value, sent_as):
    """JSON Schema counts 1851.0 an integer; a client that sends it gets 1851, and 2.5 a 400 naming the field."""
    request = parse(body)
    assert getattr(request, field) == value and type(getattr(request, field)) is type(value)
    error = refused(parse, {**body, sent_as: [1.5] if isinstance(value, list) else 2.5})
    assert error.param == sent_as, error.message
    assert isinstance(value, list) or f"{sent_as} must be an integer, got 2.5" in error.message


def test_a_bool_is_no_integer():
    assert refused(chat, {"messages": [USER], "max_tokens": True}).param == "max_tokens"


@pytest.mark.parametrize("parse, extra, param", [
    (chat, {"metadata": {"k": 1}}, "metadata"), (chat, {"service_tier": "fastest"}, "service_tier"),
    (chat, {"prompt_cache_key": 5}, "prompt_cache_key"), (chat, {"safety_identifier": []}, "safety_identifier"),
    (lambda b: responses_api.chat_request(json.dumps({"input": "x", **b}).encode()), {"metadata": "x"}, "metadata"),
    (lambda b: responses_api.chat_request(json.dumps({"input": "x", **b}).encode()), {"service_tier": 1},
     "service_tier"),
    (lambda b: responses_api.chat_request(json.dumps({"input": "x", **b}).encode()),
     {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    (lambda b: messages_api.chat_request(json.dumps({"max_tokens": 4, **b}).encode()), {"metadata": "x"},
     "metadata"),
    (lambda b: messages_api.chat_request(json.dumps({"max_tokens": 4, **b}).encode()),
     {"metadata": {"user_id": 5}}, "metadata"),
    (lambda b: messages_api.chat_request(json.dumps({"max_tokens": 4, **b}).encode()), {"service_tier": "fast"},
     "service_tier"),
    (lambda b: messages_api.chat_request(json.dumps({"max_tokens": 4, **b}).encode()), {"cache_control": "x"},
     "cache_control"),
])
def test_wrongly_typed_hints_are_refused_not_ignored(parse, extra, param):
    body = {"messages": [USER], **extra}
    assert refused(parse, body).param == param


def test_hints_of_the_right_type_pass():
    chat({"messages": [USER], "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "p"})
    messages_api.chat_request(json.dumps({"max_tokens": 4, "messages": [USER], "metadata": {"user_id": None},
                                          "service_tier": "standard_only"}).encode())


def test_messages_max_tokens_null_is_refused_and_count_tokens_needs_none():
    error = refused(lambda b: messages_api.chat_request(json.dumps(b).encode()),
                    {"messages": [USER], "max_tokens": None})
    assert error.param == "max_tokens" and "null" in error.message
    counted = messages_api.chat_request(json.dumps({"messages": [USER]}).encode(), messages_api.CountTokensRequest)
    assert counted.max_tokens is None


def test_counts_in_errors_carry_their_units():
    with pytest.raises(APIError) as info:
        max_tokens(32768, 42002, None, "messages")
    assert info.value.message == ("this model's maximum context length is 32768 tokens, and the prompt (messages) "
                                  "has 42002 tokens; shorten it")
    with pytest.raises(APIError) as info:
        max_tokens(256, 200, 100, "prompt", "max_output_tokens")
    assert "the prompt has 200 tokens, and max_output_tokens asks for 100 more: 300 tokens" in info.value.message
    assert info.value.param == "max_output_tokens"
    with pytest.raises(APIError) as info:
        check_capacity(4, chat({"messages": [USER], "n": 8}), 1)
    assert "8 completions" in info.value.message and "(4 requests, --max-waiting)" in info.value.message


def test_echo_suffix_and_top_logprobs_are_not_declared():
    """Refused unless they ask for nothing, so the published schema does not offer them."""
    assert "echo" not in CompletionRequest.model_json_schema()["properties"]
    assert "suffix" not in CompletionRequest.model_json_schema()["properties"]
    assert "top_logprobs" not in responses_api.ResponsesRequest.model_json_schema()["properties"]
    assert refused(lambda b: parse_request(json.dumps(b).encode(), CompletionRequest),
                   {"prompt": "x", "echo": True}).param == "echo"
    parse_request(json.dumps({"prompt": "x", "echo": False, "suffix": ""}).encode(), CompletionRequest)


def test_through_the_server_the_client_field_and_units_are_named(http):
    """The context check runs in the route: /v1/responses names max_output_tokens, and counts carry units."""
    answer = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 100000})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "max_output_tokens", error
    assert "max_output_tokens asks for 100000 more" in error["message"] and "max_completion" not in error["message"]
    answer = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 400}]})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "messages", error
    assert "256 tokens, and the prompt (messages) has" in error["message"] and error["message"].endswith(
        " tokens; shorten it")
    answer = http.post("/v1/responses", json={"input": "word " * 400})
    assert "the prompt (input) has" in answer.json()["error"]["message"] and \
        answer.json()["error"]["param"] == "input", answer.text


def test_health_answers_llama_servers_json(http):
    answer = http.get("/health")
    assert answer.status_code == 200 and answer.json() == {"status": "ok"}


@pytest.mark.parametrize("parse, body, param", [
    (lambda b: completion_request(json.dumps(b).encode()), {"input_prefix": "a", "input_suffix": "b",
                                                            "cache_prompt": "yes"}, "cache_prompt"),
    (lambda b: completion_request(json.dumps(b).encode()), {"input_prefix": "a", "input_suffix": "b",
                                                            "t_max_predict_ms": "soon"}, "t_max_predict_ms"),
    (lambda b: responses_api.chat_request(json.dumps(b).encode()), {"input": "x", "reasoning": {"effort": 3}},
     "reasoning"),
    (lambda b: messages_api.chat_request(json.dumps(b).encode()), {"max_tokens": 4, "messages": [USER],
                                                                   "output_config": {"effort": []}}, "output_config"),
])
def test_settings_with_no_effect_or_passed_to_the_template_are_type_checked(parse, body, param):
    assert refused(parse, body).param == param


def test_a_clients_own_keys_and_a_unions_forms_are_named():
    """A key of the client's (metadata's 'user-id') stays in the path; a union field's error names every form."""
    error = refused(chat, {"messages": [USER], "metadata": {"user-id": 1}})
    assert error.param == "metadata" and error.message.startswith("metadata.user-id must be a string")
    error = refused(lambda body: parse_request(json.dumps(body).encode(), EmbeddingRequest), {"input": [1, "a"]})
    assert error.param == "input" and "a list of token ids" in error.message


def test_field_names_are_translated_in_the_servers_words_only():
    """Chat's `stop` reads `stop_sequences` on the Messages API, but a client's own quoted value is left alone."""
    from pagellm.server.converted_requests import outer_words

    text = "this model's messages[1] says stop must be 'stop me' (['stop', \"it's stop\"])"
    assert outer_words(text, {"stop": "stop_sequences"}, ["messages[0]", "system[0]"]) == \
        "this model's system[0] says stop_sequences must be 'stop me' (['stop', \"it's stop\"])"
