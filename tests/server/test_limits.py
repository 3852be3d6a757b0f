"""Health while loading, API keys, the bounded waiting queue (429), disconnects, and SIGTERM.

The server runs one request at a time (--max-num-seqs 1) with room for one waiting request
(--max-waiting 1), so which request runs, waits or is refused is deterministic.
"""

from __future__ import annotations

import json
import signal
import socket

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from pagellm.config import EngineConfig
from pagellm.server.api_server import build_app
from tests.server.server_harness import BASE_ARGS, GEMMA_CHAT, sse_events, start_server, stop_with

KEY = "secret-key"
SECOND_KEY = "second-key"  # from --api-key-file
NAME = "limits-test"
# Long enough that no host finishes it while a test holds it open (the tests end it: a close, a SIGTERM); a
# request that finished first would fail those tests rather than pass them by chance.
MAX_MODEL_LEN = 4096
LONG = {"model": NAME, "prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# operators\n{SECOND_KEY}\n\n")
    args = [*BASE_ARGS, *GEMMA_CHAT, "--max-num-seqs", "1", "--max-waiting", "1", "--served-model-name", NAME,
            "--api-key-file", str(key_file), "--max-request-bytes", "65536", "--max-model-len", str(MAX_MODEL_LEN)]
    server = start_server(args, tmp_path_factory.mktemp("limits"), api_key=KEY)
    yield server
    server.kill()  # normally already stopped by the SIGTERM test


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as http:
        yield http


def first_event(lines):
    """The first event of an SSE line iterator. Keep the iterator: dropping it closes the connection."""
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: "):])
    raise AssertionError("stream ended without an event")


def idle(metrics) -> bool:
    return (metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0
            and metrics["kv_blocks_free"] == metrics["kv_blocks_total"])


def test_health_answers_503_while_loading_then_200(server):
    # While loading: an app whose engine never starts (its lifespan starts it; this client never runs one). The
    # server below now loads faster than its harness polls, so its own 503s are not always seen.
    loading = TestClient(build_app(EngineConfig())).get("/health")
    assert loading.status_code == 503 and loading.json()["error"]["message"] == "loading"
    assert server.health_statuses[-1] == 200
    assert httpx.get(server.url + "/health").status_code == 200  # no API key needed


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
          ("POST", "/infill"), ("POST", "/v1/embeddings"),
          ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json"),
          ("GET", "/props"), ("GET", "/static/other.js"), ("GET", "/nope")]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_but_health_needs_a_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
                    {"x-api-key": f"{KEY}x"}, {"x-api-key": f"Bearer {KEY}"}):
        response = httpx.request(method, server.url + path, headers=headers, json={})
        assert response.status_code == 401, (path, headers, response.text)
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    for key in (KEY, SECOND_KEY):  # --api-key and --api-key-file both open it, as Bearer or as x-api-key
        for headers in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
            response = httpx.request(method, server.url + path, headers=headers, json={})
            assert response.status_code != 401, (path, response.text)


def test_the_chat_page_and_its_files_open_without_a_key(server):
    """They hold no data; the page asks for the key and sends it with its calls (test_chat_page.py)."""
    for path in ("/", "/static/chat.js", "/static/chat.css"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_bodies_too_large_or_too_deep_and_requests_that_can_never_fit(http):
    big = http.post("/v1/completions", content=b'{"prompt": "' + b"x" * 70000 + b'"}',
                    headers={"content-type": "application/json"})
    assert big.status_code == 413 and "65536" in big.json()["error"]["message"]
    chunked = http.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 70000, b'"}']))
    assert chunked.status_code == 413  # no Content-Length: counted as it streams in
    deep = http.post("/v1/completions", content=b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}")
    assert deep.status_code == 400 and "nested" in deep.json()["error"]["message"]
    deep_messages = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": '
                              + b"[" * 5000 + b"]" * 5000 + b"}]}")
    assert deep_messages.status_code == 400
    never = http.post("/v1/completions", json={"model": NAME, "prompt": "x", "n": 2, "max_tokens": 1})
    assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text  # --max-waiting 1
    too_many = http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                       "max_completion_tokens": 10**9})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_completion_tokens"


def test_api_key_is_required_on_v1(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(server.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["message"] and error["code"] is None
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30).models.list()
    assert [m.id for m in models.data] == [NAME]


def test_full_waiting_queue_is_a_429_and_accepted_requests_finish(server, http):
    before = server.metrics()
    running = http.send(http.build_request("POST", "/v1/completions", json={**LONG, "stream": True}), stream=True)
    try:
        assert running.status_code == 200
        running_lines = running.iter_lines()
        assert first_event(running_lines)["choices"][0]["text"] is not None  # it runs, holding the only slot
        queued = http.send(http.build_request("POST", "/v1/completions",
                                              json={**LONG, "max_tokens": 3, "stream": True}), stream=True)
        try:
            assert queued.status_code == 200  # accepted: it waits
            refused = http.post("/v1/completions", json={**LONG, "max_tokens": 3})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert refused.headers["retry-after"] == "1"
            running.close()  # the client goes away: its request is aborted, the queued one runs
            events = sse_events(queued.iter_lines())
        finally:
            queued.close()
    finally:
        running.close()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    after = server.wait_for_metrics(idle)
    assert idle(after), after  # the aborted request's blocks are back in the pool
    assert after["request_aborted_total"] - before["request_aborted_total"] == 1
    assert after["request_success_total"] - before["request_success_total"] == 1


def send_raw(server, path: str, body: dict) -> socket.socket:
    """A POST written to a socket of its own, nothing read back: the test decides when the client goes away."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAuthorization: Bearer {KEY}\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(head.encode() + payload)
    return sock


def test_non_streaming_client_that_goes_away_is_aborted(server):
    before = server.metrics()
    sock = send_raw(server, "/v1/completions", LONG)
    try:
        running = server.wait_for_metrics(lambda m: m["num_requests_running"] == 1)  # 60 s: a hang guard only
        assert running["num_requests_running"] == 1, running
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # no answer yet: it is still generating when the client goes away
            sock.recv(1)
    finally:
        sock.close()
    after = server.wait_for_metrics(lambda m: idle(m) and m["request_aborted_total"] > before["request_aborted_total"])
    assert idle(after), after
    assert after["request_aborted_total"] - before["request_aborted_total"] == 1
    assert after["request_success_total"] == before["request_success_total"]  # it never ran to the end


def test_sigterm_ends_open_streams_with_an_error_and_exits_zero(server, http):
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        first_event(lines)
        server.signal(signal.SIGTERM)
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
    stop_with(server, signal.SIGTERM)
