"""The engine thread under faults, in process (FastAPI's TestClient runs the app and its engine thread): a step
that fails because of one request fails that request alone; an error outside a step (delivery) ends the thread,
and then /health and every new request answer 503 at once instead of hanging."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
from fastapi.testclient import TestClient

from pagellm.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from pagellm.server.api_server import build_app

CONFIG = EngineConfig(model=ModelConfig(max_model_len=256), cache=CacheConfig(kv_cache_memory=0.25))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


HANG_GUARD = 240  # seconds: only so that a hang fails instead of blocking the suite; no speed is measured


def ready_client(app) -> TestClient:
    client = TestClient(app)
    client.__enter__()  # runs the lifespan: the engine thread starts loading the model
    deadline = time.monotonic() + HANG_GUARD
    while client.get("/health").status_code != 200:
        if time.monotonic() > deadline:  # hang guard: loading takes what it takes on a busy 2-core machine
            pytest.fail("the model did not load")
        time.sleep(0.1)
    return client


def bounded(fn, *args):
    """fn(*args) on another thread, waited for under the hang guard: a request queued for an engine thread that
    has ended would never be answered, and the test would block."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=HANG_GUARD)
    finally:
        pool.shutdown(wait=False)


def complete(client: TestClient, prompt: str):
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})


@pytest.fixture(scope="module")
def served():
    app = build_app(CONFIG, ServerConfig())
    client = ready_client(app)
    yield client, app.state.server.engine
    client.__exit__(None, None, None)


@pytest.mark.parametrize("fault, status, said", [
    (RuntimeError("injected fault"), 500, "injected fault"),
    (torch.OutOfMemoryError("CUDA out of memory (injected)"), 503, "the device ran out of memory"),
], ids=["error", "out-of-memory"])
def test_a_step_that_one_request_breaks_fails_that_request_alone(served, fault, status, said):
    """The failing request alone gets an error (a device out of memory: 503, worth a retry), the others their
    text, and the server goes on."""
    client, async_engine = served
    with ThreadPoolExecutor(4) as pool:
        expected = [r.json()["choices"][0]["text"] for r in pool.map(lambda p: complete(client, p), PROMPTS)]
    engine = async_engine._engine  # faults injected into the engine itself, behind AsyncEngine
    launch = engine.executor.launch

    def faulty(output):  # injected: any step holding the poisoned prompt's request fails
        if any(item.request_id in poisoned for item in output.scheduled):
            raise fault
        return launch(output)

    poisoned = set()
    engine.executor.launch = faulty
    try:
        tokens = client.post("/tokenize", json={"prompt": "POISON"}).json()["tokens"]
        original_add = engine.add_request

        def add_request(prompt, params=None, request_id=None, arrival_time=None):
            if list(prompt) == tokens:
                poisoned.add(request_id)
            return original_add(prompt, params, request_id, arrival_time)

        engine.add_request = add_request
        with ThreadPoolExecutor(5) as pool:
            results = list(pool.map(lambda p: complete(client, p), [*PROMPTS[:2], "POISON", *PROMPTS[2:]]))
    finally:
        engine.executor.launch = launch
        del engine.add_request
    bad = results.pop(2)
    assert bad.status_code == status and said in bad.json()["error"]["message"], bad.text
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert [r.json()["choices"][0]["text"] for r in results] == expected  # untouched by the isolation
    assert client.get("/health").status_code == 200
    assert complete(client, PROMPTS[0]).json()["choices"][0]["text"] == expected[0]
    stats = async_engine.stats()
    assert stats["engine_step_failures"] >= 1 and stats["num_requests_failed"] >= 1


def test_an_error_in_delivery_ends_the_engine_and_everything_answers_503_at_once():
    app = build_app(CONFIG, ServerConfig())
    client = ready_client(app)
    async_engine = app.state.server.engine
    try:
        def broken(outputs):
            raise KeyError("injected delivery fault")

        async_engine._deliver = broken
        failed = bounded(complete, client, PROMPTS[0])
        assert failed.status_code == 503 and "injected delivery fault" in failed.json()["error"]["message"]
        # The thread records why it died before it fails the open requests: /health knows by the time the
        # request above was answered, with no wait.
        health = client.get("/health")
        assert health.status_code == 503
        assert "engine thread died" in health.json()["error"]["message"]
        assert "injected delivery fault" in health.json()["error"]["message"]
        async_engine._thread.join(HANG_GUARD)  # hang guard: it ends once its engine is shut down
        assert not async_engine._thread.is_alive()
        # "At once" is a state, not a time: nobody is left to answer, so a new request must be refused at the
        # door, never queued for the engine thread (queued, it would wait forever: bounded() would fail).
        submitted, submit, inbox = [], async_engine._submit, list(async_engine._inbox)
        async_engine._submit = lambda fn, future: (submitted.append(fn), submit(fn, future))[1]
        for path, body in (("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}]})):
            again = bounded(partial(client.post, path, json=body))
            assert again.status_code == 503, again.text
            assert "engine thread died" in again.json()["error"]["message"]
        # (the inbox already holds the failed request's own abort, sent after the thread ended: never run)
        assert submitted == [] and list(async_engine._inbox) == inbox
    finally:
        client.__exit__(None, None, None)


def test_a_model_too_large_for_the_device_says_so_on_health(monkeypatch):
    """Out of device memory while loading: /health answers 503 naming memory and what to lower."""
    import pagellm.engine

    def too_large(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(pagellm.engine, "LLMEngine", too_large)
    app = build_app(CONFIG, ServerConfig())
    with TestClient(app) as client:
        deadline = time.monotonic() + HANG_GUARD
        while (health := client.get("/health")).status_code == 503 and "loading" in health.text:
            assert time.monotonic() < deadline, "the load never ended"
            time.sleep(0.05)
        message = health.json()["error"]["message"]
    assert health.status_code == 503 and "does not fit in the device's memory" in message
    assert "--max-model-len" in message and "Tried to allocate 2.00 GiB" in message
