"""The names a server answers to (--served-model-name, several as vLLM takes; by default the model's file name,
a GGUF's without its extension), what an unknown one gets (a 404 where the client's API answers one, the name
cut short), and unknown request fields logged within bounds."""

from __future__ import annotations

import logging
import types

import pytest
from fastapi.testclient import TestClient

from pagellm.config import EngineConfig, ServerConfig
from pagellm.server.api_server import build_app, default_model_names
from pagellm.server.errors import APIError
from pagellm.server.state import UNKNOWN_FIELDS_LOGGED, UNKNOWN_FIELDS_REMEMBERED, ServerState


def test_a_gguf_answers_to_its_name_without_the_extension_first():
    assert default_model_names("/models/qwen2.5-coder-0.5b-q4km.gguf") == ("qwen2.5-coder-0.5b-q4km",
                                                                          "qwen2.5-coder-0.5b-q4km.gguf")
    assert default_model_names("/models/Qwen2.5-0.5B/") == ("Qwen2.5-0.5B",)
    assert default_model_names(None) == ("gemma-3-270m",)


def test_served_model_name_takes_several_names_the_first_answered():
    app = build_app(EngineConfig(), ServerConfig(served_model_name=["coder", "claude-sonnet-4-5"]))
    state: ServerState = app.state.server
    assert state.served_model_name == "coder" and state.model_names == ("coder", "claude-sonnet-4-5")
    for name in (None, "coder", "claude-sonnet-4-5"):
        state.check_model(name)
    # /v1/models lists each, as vLLM does (the app unstarted: no model loaded, no lifespan)
    listed = TestClient(app).get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["coder", "claude-sonnet-4-5"]
    assert ServerConfig(served_model_name="one").served_model_name == ("one",)
    with pytest.raises(ValueError, match="served_model_name"):
        ServerConfig(served_model_name=["a", ""])


def test_an_unknown_name_is_a_404_listing_the_names_and_cut_short():
    state = ServerState(engine=None, metrics=None, served_model_name="m", created=0, model_aliases=("alias",))
    with pytest.raises(APIError) as openai_route:
        state.check_model("x" * 3_000_000)
    error = openai_route.value
    assert error.status == 404 and error.param == "model" and error.kind == "not_found_error"
    assert "'m', 'alias'" in error.message and len(error.message) < 300
    with pytest.raises(APIError) as llama_route:  # llama-server's routes: a 400
        state.check_model("other", "llama")
    assert llama_route.value.status == 400


def test_an_unknown_model_over_http(http):
    """OpenAI's shape and a 404 under /v1, Anthropic's under /v1/messages, a 400 on /detokenize; never whole."""
    name = "n" * 200_000
    chat = http.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 404 and chat.json()["error"]["param"] == "model" and len(chat.content) < 1000
    messages = http.post("/v1/messages", json={"model": "claude-x", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert messages.status_code == 404 and messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "not_found_error"
    detokenize = http.post("/detokenize", json={"model": name, "tokens": [1]})
    assert detokenize.status_code == 400 and len(detokenize.content) < 1000
    assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["gemma-3-270m"]


def test_unknown_fields_are_logged_within_bounds(caplog):
    state = ServerState(engine=None, metrics=None, served_model_name="m", created=0)
    body = types.SimpleNamespace(unknown_fields=lambda: [f"k{i}" for i in range(20_000)] + ["y" * 1_000_000])
    with caplog.at_level(logging.WARNING, logger="pagellm.server"):
        state.note_unknown_fields(body)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == UNKNOWN_FIELDS_LOGGED + 1 and "more unknown request fields" in lines[-1]
    assert max(map(len, lines)) < 300
    for request in range(UNKNOWN_FIELDS_REMEMBERED):  # a server's memory of names is bounded too
        state.note_unknown_fields(types.SimpleNamespace(unknown_fields=lambda r=request: [f"z{r}-" + "q" * 500]))
    assert len(state.unknown_fields_seen) == UNKNOWN_FIELDS_REMEMBERED
    assert sum(map(len, state.unknown_fields_seen)) < UNKNOWN_FIELDS_REMEMBERED * 100
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagellm.server"):
        state.note_unknown_fields(types.SimpleNamespace(unknown_fields=lambda: ["long-after"]))
    assert not caplog.records
