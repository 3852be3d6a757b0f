"""Request parsing and response shapes, without a server or a model."""

from __future__ import annotations

import json

import pytest

from pagellm.core.types import TokenLogprobs
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams
from pagellm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from pagellm.server.responses import ChatFormatter, CompletionFormatter, usage


def parse(model, body: str):
    return parse_request(body.encode(), model)


@pytest.mark.parametrize("body,param", [
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "x", "temperature": "hot"}', "temperature"),
    ('{"prompt": [[1], "a"]}', "prompt"),
    ('{"prompt": "x", "stop": [""]}', None),  # caught when the SamplingParams are built
    (json.dumps({"prompt": "x", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}), None),
    (json.dumps({"prompt": "x", "stop": "a" * (MAX_STOP_LENGTH + 1)}), None),
    ('{"max_tokens": 3}', "prompt"),
    ('{"prompt": "x", "prompt_logprobs": 21}', "prompt_logprobs"),
    ('{"prompt": "x", "prompt_logprobs": -1}', "prompt_logprobs"),
    ('{"prompt": "x", "prompt_logprobs": 1, "stream": true}', "prompt_logprobs"),
])
def test_completion_errors_name_the_field(body, param):
    if param is None:
        request = parse(CompletionRequest, body)
        with pytest.raises(APIError) as info:
            request.sampling_params(4, None, 0)
        assert info.value.param == "stop"
        return
    with pytest.raises(APIError) as info:
        parse(CompletionRequest, body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_nested_message_errors_name_the_path_in_message_and_param():
    with pytest.raises(APIError) as info:
        parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}')
    assert info.value.param == "messages[1].role" and info.value.message.startswith("messages[1].role is required")
    with pytest.raises(APIError) as info:
        parse(ChatCompletionRequest, '{"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}')
    assert info.value.param == "messages[0].tool_calls[0].function.name", info.value.message


def test_prompt_forms_and_child_seeds():
    assert parse(CompletionRequest, '{"prompt": "a"}').prompts() == ["a"]
    assert parse(CompletionRequest, '{"prompt": [1, 2]}').prompts() == [[1, 2]]
    assert parse(CompletionRequest, '{"prompt": [[1], [2]]}').prompts() == [[1], [2]]
    request = parse(CompletionRequest, '{"prompt": "a", "seed": 5, "n": 3, "temperature": 0.5}')
    assert [request.sampling_params(4, None, i).seed for i in range(3)] == [5, 6, 7]
    chat = parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
                                        ' "max_completion_tokens": 3, "max_tokens": 9, "logprobs": true}')
    assert chat.requested_max_tokens == 3 and chat.num_logprobs == 0
    assert chat.messages[0].as_template_dict() == {"role": "user", "content": "hi"}


def _output(rid: str, text: str, ids: list[int], finished: bool, cached: int = 0, new_text: str = "",
            logprobs=None) -> RequestOutput:
    completion = CompletionOutput(0, text, ids, "length" if finished else None, logprobs)
    return RequestOutput(rid, None, [1, 2, 3], [completion], finished, cached, ids[-1:], new_text)


def test_usage_counts_each_prompt_once_and_its_shared_cached_prefix():
    outputs = [_output("a", "", [5, 6], True, cached=0), _output("b", "", [7], True, cached=16),
               _output("c", "", [8, 9, 10], True, cached=32), _output("d", "", [1], True, cached=0)]
    assert usage([40, 20], outputs, n=2) == {
        "prompt_tokens": 60, "completion_tokens": 7, "total_tokens": 67,
        "prompt_tokens_details": {"cached_tokens": 16 + 32}}


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def test_stream_chunks_hold_logprobs_until_text_is_released():
    request = parse(CompletionRequest, '{"prompt": "a", "logprobs": 1, "stream": true}')
    formatter = CompletionFormatter("m", request, _Tokenizer())
    lp = [TokenLogprobs(5, -0.5, 1, ((5, -0.5),)), TokenLogprobs(6, -1.0, 1, ((6, -1.0),))]
    assert formatter.chunk(0, _output("a", "", [5], False, logprobs=lp[:1]), False) is None  # held back
    chunk = formatter.chunk(0, _output("a", "xy", [5, 6], True, new_text="xy", logprobs=lp), True)
    choice = chunk["choices"][0]
    assert choice["text"] == "xy" and choice["finish_reason"] == "length" and chunk["usage"] is None
    assert choice["logprobs"]["tokens"] == ["<5>", "<6>"] and choice["logprobs"]["text_offset"] == [0, 3]


def test_chat_response_shape():
    request = parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "hi"}], "n": 2}')
    formatter = ChatFormatter("m", request, _Tokenizer())
    assert [c["choices"][0]["delta"]["role"] for c in formatter.first_chunks(2, False)] == ["assistant"] * 2
    outputs = [_output("a", "one", [5], True), _output("b", "two", [6], True)]
    response = formatter.response(outputs, usage([3], outputs, 2))
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert [c["message"] for c in response["choices"]] == [{"role": "assistant", "content": "one"},
                                                            {"role": "assistant", "content": "two"}]


def test_prompt_logprobs_go_to_the_first_child_only_and_never_to_a_stream():
    request = parse(CompletionRequest, '{"prompt": "a", "n": 2, "prompt_logprobs": 3}')
    assert [request.sampling_params(4, None, child).prompt_logprobs for child in range(2)] == [3, None]
    streamed = parse(CompletionRequest, '{"prompt": "a", "prompt_logprobs": 0, "stream": true}')  # vLLM accepts 0
    assert streamed.sampling_params(4, None, 0).prompt_logprobs is None


def test_prompt_logprobs_wire_shape_per_choice_and_beside_chat_choices():
    scored = [None, {7: Logprob(-0.25, 2, "x"), 9: Logprob(float("-inf"), 1, "y")}]
    outputs = [_output("a", "one", [5], True), _output("b", "two", [6], True)]
    outputs[0].prompt_logprobs = scored  # child 0 of the prompt computed them for both choices
    wire = [None, {"7": {"logprob": -0.25, "rank": 2, "decoded_token": "x"},
                   "9": {"logprob": -9999.0, "rank": 1, "decoded_token": "y"}}]
    completion = CompletionFormatter("m", parse(CompletionRequest, '{"prompt": "a", "n": 2}'), _Tokenizer())
    response = completion.response(outputs, usage([3], outputs, 2))
    assert [c["prompt_logprobs"] for c in response["choices"]] == [wire, wire]
    chat = ChatFormatter("m", parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "hi"}]}'),
                         _Tokenizer())
    assert chat.response(outputs[:1], usage([3], outputs[:1], 1))["prompt_logprobs"] == wire
    outputs[0].prompt_logprobs = None
    assert chat.response(outputs[:1], usage([3], outputs[:1], 1))["prompt_logprobs"] is None


@pytest.mark.parametrize("model, field, value", [
    (CompletionRequest, "best_of", 3), (CompletionRequest, "allowed_token_ids", [3]),
    (CompletionRequest, "bad_words", ["x"]),
    (ChatCompletionRequest, "functions", [{"name": "f"}]), (ChatCompletionRequest, "function_call", {"name": "f"}),
    (ChatCompletionRequest, "tool_choice", "required"), (ChatCompletionRequest, "use_beam_search", True),
    (ChatCompletionRequest, "include_stop_str_in_output", True), (ChatCompletionRequest, "audio", {"voice": "x"}),
    (ChatCompletionRequest, "modalities", ["text", "audio"]), (ChatCompletionRequest, "chat_template", "{{ x }}"),
    (ChatCompletionRequest, "reasoning_effort", "high"), (CompletionRequest, "skip_special_tokens", False),
    (CompletionRequest, "truncate_prompt_tokens", 5), (ChatCompletionRequest, "echo", True),
])
def test_fields_not_honoured_yet_are_refused_by_name(model, field, value):
    """A constraint the server would ignore is a 400 naming it, never a 200 that silently breaks it."""
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError) as info:
        parse(model, json.dumps({**base, field: value}))
    assert info.value.status == 400 and info.value.param == field


@pytest.mark.parametrize("field, value", [("allowed_token_ids", []), ("best_of", 1),
                                          ("response_format", {"type": "text"}), ("tool_choice", "none"),
                                          ("function_call", "auto"), ("guided_json", None)])
def test_values_that_ask_for_nothing_pass_and_unknown_fields_are_reported(field, value):
    request = parse(ChatCompletionRequest, json.dumps(
        {"messages": [{"role": "user", "content": "x"}], field: value, "temperatur": 0.5, "metadat": {"a": 1},
         "metadata": {"a": "1"}, "service_tier": "auto", "modalities": ["text"], "skip_special_tokens": True}))
    assert request.unknown_fields() == ["metadat", "temperatur"]


def test_the_server_logs_each_unknown_field_once(caplog):
    from pagellm.server.state import ServerState

    state = ServerState(engine=None, metrics=None, served_model_name="m", created=0)
    body = '{"prompt": "x", "temperatur": 0.5}'
    with caplog.at_level("WARNING", logger="pagellm.server"):
        for _ in range(3):
            state.note_unknown_fields(parse(CompletionRequest, body))
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring request field 'temperatur', which pagellm does not know (logged once)"]
    state.text_pool.shutdown()


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"), ('{"prompt": "x", "logit_bias": {"a": 1}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"5": "up"}}', "logit_bias"), ('{"prompt": "x", "min_tokens": -1}', "min_tokens"),
    ('{"prompt": "x", "min_tokens": 9, "max_tokens": 4}', "min_tokens"),
])
def test_logit_bias_and_min_tokens_are_checked(body, param):
    with pytest.raises(APIError) as info:
        parse(CompletionRequest, body).sampling_params(4 if "max_tokens" in body else 16, None, 0)
    assert info.value.param == param


def test_logit_bias_and_min_tokens_reach_the_sampling_params():
    params = parse(CompletionRequest, '{"prompt": "x", "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 2}'
                   ).sampling_params(8, None, 0)
    assert params.logit_bias == ((3, 2.5), (7, -100.0)) and params.min_tokens == 2


def test_chat_template_kwargs_may_not_set_the_template_call_s_own_arguments():
    ok = parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "x"}], '
                                      '"chat_template_kwargs": {"enable_thinking": false}}')
    assert ok.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(APIError) as info:
        parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "x"}], '
                                     '"chat_template_kwargs": {"tokenize": true}}')
    assert info.value.param == "chat_template_kwargs"


def test_serve_refuses_a_chat_template_file_it_cannot_read(tmp_path, capsys):
    from pagellm.cli import main

    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err


# Every sampling field a request may set, each with a value no other field has and no field defaults to: a field
# dropped (left at its default) or read into another one's place changes the SamplingParams.
SAMPLING_FIELDS = {"temperature": 0.7, "top_p": 0.9, "top_k": 14, "min_p": 0.05, "presence_penalty": 0.3,
                   "frequency_penalty": -0.4, "repetition_penalty": 1.25, "seed": 11, "stop": ["zz"],
                   "stop_token_ids": [17], "ignore_eos": True, "logit_bias": {"5": 2.5}, "min_tokens": 2,
                   "prompt_logprobs": 3}


@pytest.mark.parametrize("model, base", [(CompletionRequest, {"prompt": "x", "logprobs": 4}),
                                         (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                                  "logprobs": True, "top_logprobs": 4})])
def test_every_sampling_field_reaches_the_sampling_params_under_its_own_name(model, base):
    request = parse(model, json.dumps({**base, **SAMPLING_FIELDS}))
    num_logprobs = request.logprobs if model is CompletionRequest else request.num_logprobs
    params = request.sampling_params(9, num_logprobs, 0)
    assert {name: getattr(params, name) for name in SAMPLING_FIELDS} == {
        **SAMPLING_FIELDS, "stop": ("zz",), "stop_token_ids": (17,), "logit_bias": ((5, 2.5),)}
    assert params.max_tokens == 9 and params.logprobs == 4
    assert request.sampling_params(9, num_logprobs, 2).seed == 13  # child i: seed + i
    # the values are distinct, so the comparison above tells any two fields apart
    numbers = [v for v in SAMPLING_FIELDS.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert len(set(numbers)) == len(numbers)
    # and none is the field's default: a field dropped on the way would show
    defaults = SamplingParams()
    assert all(getattr(defaults, name) != getattr(params, name) for name in SAMPLING_FIELDS)
