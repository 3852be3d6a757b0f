"""Fuzzing the HTTP API (hypothesis, bounded): bodies shaped by the request models' own fields, with values both
plausible and arbitrary JSON, plus raw bytes. No answer may be a 5xx, and the server stays healthy.

A dedicated server with a 16-token context keeps every valid request short (conftest.py's fuzz_server, which
test_openapi_fuzz.py shares)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagellm.server.embeddings import EmbeddingRequest
from pagellm.server.infill import InfillRequest
from pagellm.server.messages_api import MessagesRequest
from pagellm.server.responses_api import ResponsesRequest

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest, "/tokenize": TokenizeRequest,
          "/detokenize": DetokenizeRequest, "/infill": InfillRequest, "/v1/embeddings": EmbeddingRequest}
SCALARS = st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False) | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])},
                                optional={"content": st.text(max_size=20) | JSON, "tool_call_id": st.text(max_size=5),
                                          "tool_calls": JSON})
PLAUSIBLE = {  # per field, values near what a client sends (the rest of the time: any JSON)
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 300000), max_size=5),
    "messages": st.lists(MESSAGE, max_size=3),
    "input": st.text(max_size=30) | st.lists(MESSAGE | st.fixed_dictionaries(
        {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
        optional={"call_id": st.text(max_size=4) | JSON, "name": st.text(max_size=4) | JSON, "arguments": JSON,
                  "output": JSON, "role": st.sampled_from(["user", "assistant"]), "content": JSON}), max_size=3),
    "max_output_tokens": st.integers(-2, 40),
    "input_prefix": st.text(max_size=10), "input_suffix": st.text(max_size=10), "n_predict": st.integers(-3, 40),
    "system": st.text(max_size=10) | st.lists(JSON, max_size=2), "stop_sequences": st.lists(st.text(max_size=3)),
    "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "json_schema"}},
                             {"format": {"type": "json_schema", "schema": {"type": "integer"}}}]),
    "tokens": st.lists(st.integers(-5, 300000), max_size=5),
    "max_tokens": st.integers(-2, 40), "max_completion_tokens": st.integers(-2, 40), "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3), "logprobs": st.booleans() | st.integers(-1, 25),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {}},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}]),
    "guided_regex": st.sampled_from(["[a-z]{2}", "(", "\\d+"]), "guided_choice": st.lists(st.text(max_size=4)),
    "tools": st.lists(JSON, max_size=2), "tool_choice": st.sampled_from(["auto", "none", "required", {"x": 1}]),
    "logit_bias": st.dictionaries(st.text(max_size=7), st.integers(-200, 200) | st.floats(), max_size=3),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "stream": st.booleans(), "model": st.sampled_from(["fuzz", "other"]),
}


def bodies(model) -> st.SearchStrategy:
    optional = {name: PLAUSIBLE.get(name, JSON) | JSON for name in model.model_fields}
    return st.fixed_dictionaries({}, optional=optional).map(lambda body: json.dumps(body).encode()) | st.binary(
        max_size=64)


@pytest.mark.parametrize("path", list(ROUTES))
def test_no_body_gets_a_5xx(fuzz_server, path):
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        @settings(max_examples=200, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=bodies(ROUTES[path]))
        def check(body: bytes):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code < 500, (body, response.status_code, response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"]

        check()
        assert http.get("/health").status_code == 200
