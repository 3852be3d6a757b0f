"""One `pagellm serve` of the embedded model, shared by the test files that need no special flags."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from tests.server.server_harness import BASE_ARGS, GEMMA_CHAT, start_server, stop_with


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    server = start_server([*BASE_ARGS, *GEMMA_CHAT], tmp_path_factory.mktemp("serve"))
    yield server
    stop_with(server, signal.SIGINT)  # Ctrl-C: a clean exit, status 0, no traceback


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory):
    """A server for fuzzing (test_fuzz.py, test_openapi_fuzz.py): a 16-token context keeps every valid request
    short, a queue of 8 refuses a request of more completions (n, prompts) at once, and Gemma's turn format takes
    chat past the template."""
    server = start_server(["--kv-cache-memory", "0.1", "--max-model-len", "16", "--max-num-seqs", "4",
                           "--max-waiting", "8", "--served-model-name", "fuzz", *GEMMA_CHAT],
                          tmp_path_factory.mktemp("fuzz"))
    yield server
    stop_with(server, signal.SIGINT)


# The server closes idle keep-alive connections after 5 s (uvicorn's timeout_keep_alive); a client that reuses
# one at that moment gets "server disconnected". Clients here drop idle connections first.
KEEPALIVE = httpx.Limits(keepalive_expiry=2.0)


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0,
                         http_client=httpx.Client(limits=KEEPALIVE, timeout=120))


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, limits=KEEPALIVE) as http:
        yield http
