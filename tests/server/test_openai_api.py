"""`pagellm serve` on the embedded Gemma 3 270M, through the official openai client and raw HTTP."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

MODEL = "gemma-3-270m"
N = 4  # tokens per greedy completion: few, since a step takes 50-100 ms on a 2-core CPU
PROMPT = "The capital of France is"
# Long enough for two full 16-token KV blocks, and used by no other test (a cold prefix cache).
SHARED_PROMPT = ("In a quiet harbour town, the lighthouse keeper kept a notebook of every ship that "
                 "passed, the weather on each day, and the songs the sailors sang at night. One day")


def greedy_completion(client, prompt=PROMPT, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, **kwargs)


def concurrently(*calls):
    """Run the calls at once (they batch in the engine, which keeps the tests short); their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


@pytest.fixture(scope="module")
def expected(client):
    """The greedy completion of PROMPT (N tokens)."""
    return greedy_completion(client)


def test_health_models_and_served_name(http):
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 256


def test_completion_non_streaming(expected, http):
    out = expected
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert out.usage.prompt_tokens == tokens["count"]
    assert out.usage.completion_tokens == N
    assert out.usage.total_tokens == tokens["count"] + N
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # shorter than one full block


def test_streaming_completion_matches_non_streaming(client, expected):
    expected = expected.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == N


def test_prompt_forms_give_the_same_greedy_text(client, http, expected):
    expected = expected.choices[0].text
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    single, strings, id_lists = concurrently(
        lambda: greedy_completion(client, prompt=ids),
        lambda: greedy_completion(client, prompt=[PROMPT, "def fibonacci(n):"]),
        lambda: greedy_completion(client, prompt=[ids, ids]))
    assert single.choices[0].text == expected
    assert [c.index for c in strings.choices] == [0, 1]
    assert strings.choices[0].text == expected
    assert [c.text for c in id_lists.choices] == [expected, expected]
    assert id_lists.usage.prompt_tokens == 2 * len(ids)


def test_chat_streaming_and_non_streaming(client):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=N, temperature=0)
    (choice,) = out.choices
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_stop_string_ends_the_text_before_it(client, expected):
    text = expected.choices[0].text
    words = text.split(" ")
    assert len(words) >= 3, text
    stop = " " + words[2]  # the second word, with its leading space
    out = greedy_completion(client, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_seeds_reproduce_and_n_children_use_seed_plus_i(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=5, temperature=1.0)
    both, again, eight = concurrently(lambda: client.completions.create(n=2, seed=7, **kwargs),
                                      lambda: client.completions.create(n=2, seed=7, **kwargs),
                                      lambda: client.completions.create(seed=8, **kwargs))
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in again.choices] == [c.text for c in both.choices]
    assert eight.choices[0].text == both.choices[1].text


def test_n_completions_share_the_prompt_blocks(client, server):
    before = server.metrics()
    out = client.completions.create(model=MODEL, prompt=SHARED_PROMPT, n=3, max_tokens=4, temperature=1.0,
                                    seed=1)
    assert len(out.choices) == 3
    assert out.usage.prompt_tokens >= 33  # two full blocks and more
    full_blocks = (out.usage.prompt_tokens - 1) // 16 * 16  # the last prompt token is always computed
    # Computed once by the first completion, read from the prefix cache by the other two.
    assert out.usage.prompt_tokens_details.cached_tokens == full_blocks
    after = server.metrics()
    assert after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"] == 2 * full_blocks
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 3 * out.usage.prompt_tokens


def test_completion_logprobs(client):
    out, streamed = concurrently(
        lambda: greedy_completion(client, logprobs=2),
        lambda: list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2,
                                               stream=True)))
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == logprob  # greedy: the sampled token is the top one
        assert logprob == max(top.values()) <= 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_completion_prompt_logprobs(client, http):
    """vLLM's extra field: per choice, None and then {token id: {logprob, rank, decoded_token}} per prompt token."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out, after_prefix = concurrently(
        lambda: greedy_completion(client, prompt=ids, n=2, extra_body={"prompt_logprobs": 2}),
        lambda: client.completions.create(model=MODEL, prompt=ids[:-1], max_tokens=1, temperature=0, logprobs=0))
    scored = out.choices[0].prompt_logprobs
    assert out.choices[1].prompt_logprobs == scored  # the n choices share their prompt's
    assert len(scored) == len(ids) and scored[0] is None
    for position, token in enumerate(ids[1:], start=1):
        entries = scored[position]
        assert str(token) in entries and len(entries) in (2, 3)
        assert sorted(e["rank"] for e in entries.values() if e["rank"] <= 2) == [1, 2]
        assert all(e["logprob"] <= 0 for e in entries.values())
    assert "".join(scored[i][str(t)]["decoded_token"] for i, t in enumerate(ids) if i) == PROMPT
    # the last prompt position's best token is what greedy decoding picks after the rest of the prompt
    best = next(e for e in scored[-1].values() if e["rank"] == 1)
    assert best["decoded_token"] == after_prefix.choices[0].text
    assert abs(best["logprob"] - after_prefix.choices[0].logprobs.token_logprobs[0]) < 1e-3


def test_chat_prompt_logprobs_sit_beside_the_choices(http):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    response = http.post("/v1/chat/completions", json=body).json()
    scored = response["prompt_logprobs"]
    assert len(scored) == response["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(entries) == 1 for entries in scored[1:])  # prompt_logprobs 0: the prompt token alone


def test_ignore_eos_outlasts_a_forced_eos(client):
    """logit_bias +100 on EOS makes it the greedy token at every step: with ignore_eos the output runs on to
    max_tokens; the same request without it ends on its first token. (The other sampling fields:
    test_sampling_fields.py.)"""
    eos = {str(_token_id(client, "<eos>")): 100}  # the embedded Gemma's end-of-sequence token
    ignored, ended = concurrently(lambda: greedy_completion(client, logit_bias=eos, extra_body={"ignore_eos": True}),
                                  lambda: greedy_completion(client, logit_bias=eos))
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == N
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1


def test_tokenize_and_detokenize(http):
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


def test_concurrent_requests_all_complete(client):
    outs = concurrently(*[lambda i=i: client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=4,
                                                                temperature=0) for i in range(N)])
    assert all(o.usage.completion_tokens == 4 for o in outs)


LONG_PROMPT = "hello " * 300  # over the 256-token context

BAD_REQUESTS = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 255}, "max_tokens"),  # prompt + max_tokens > context
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "seed": "7"}, "seed"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}, {"content": "x"}]}, "messages[1].role"),  # no content: ""
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[1].content[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": [1]}, "metadata"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 2}, "messages"),  # alternation
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
     "max_completion_tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{p}:{param}-{i}" for i, (p, _, param)
                                                              in enumerate(BAD_REQUESTS)])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    """An unknown model is OpenAI's 404 (test_model_names.py); the rest a 400."""
    response = http.post(path, json=body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    kind = "not_found_error" if param == "model" else "invalid_request_error"
    assert error["type"] == kind and error["param"] == param and error["code"] is None
    assert error["message"]


@pytest.mark.parametrize("raw", [b"\xff\xfe{not utf-8", b'{"prompt": "x",', b"[1, 2]", b"", b"null"])
def test_undecodable_bodies_are_a_400(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method_are_openai_errors(http):
    assert http.get("/v1/nothing").json()["error"]["message"]
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["message"]


def test_the_server_still_works_after_the_errors(client):
    assert greedy_completion(client).usage.completion_tokens == N


def test_metrics_are_exported(server):
    metrics = server.metrics()
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert metrics[name] > 0, name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queried_tokens_total",
                 "prefix_cache_hit_tokens_total", "num_preemptions_total", "host_ms_per_step",
                 "model_ms_per_step", "sample_ms_per_step", "host_syncs_per_step", "kv_blocks_free",
                 "kv_blocks_total", "decode_graph_replays_total", "decode_graph_replay_rate"):
        assert name in metrics, name
    assert metrics["generation_tokens_total"] >= metrics["e2e_request_latency_seconds_count"]
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]  # idle: every block back in the pool
    # memory: the pool, what of it is resident (idle now: only what the prefix cache's budget keeps), the hit rate
    assert 0 < metrics["kv_resident_bytes"] <= metrics["prefix_cache_budget_bytes"] < metrics["kv_pool_bytes"]
    assert metrics["prefix_cache_resident_bytes"] <= metrics["kv_resident_bytes"]
    assert 0 <= metrics["prefix_cache_hit_rate"] <= 1 and "kv_blocks_released_total" in metrics


HANG_GUARD = 120  # seconds: only a broken server waits this long


@pytest.fixture
def in_process():
    """The app in this process (FastAPI's TestClient runs it and its engine thread), for a test that reaches into
    it; the flags of the shared server."""
    from fastapi.testclient import TestClient

    from pagellm.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
    from pagellm.server.api_server import build_app

    app = build_app(EngineConfig(model=ModelConfig(max_model_len=256), cache=CacheConfig(kv_cache_memory=0.25)),
                    ServerConfig())
    with TestClient(app) as client:  # runs the lifespan: the engine thread loads the model
        deadline = time.monotonic() + HANG_GUARD
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)
        yield app, client


def test_a_long_tokenization_leaves_the_event_loop_serving(in_process, monkeypatch):
    """A multi-megabyte prompt takes seconds to tokenize. Here one prompt's tokenization is held in progress until
    the test releases it, and meanwhile /health and a short completion (its own tokenization included) answer.
    Were tokenization on the event loop, nothing would be served until the held one gave up waiting (HANG_GUARD):
    the test would not have been the one to release it."""
    app, client = in_process
    tokenizer = app.state.server.engine.model.tokenizer
    held = "The prompt whose tokenization is held in progress."
    in_progress, release, released = threading.Event(), threading.Event(), []
    encode = tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if text == held:
            in_progress.set()
            released.append(release.wait(HANG_GUARD))  # False: it gave up waiting
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(client.post, "/tokenize", json={"prompt": held})
        assert in_progress.wait(HANG_GUARD)
        health = client.get("/health")
        small = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        still_held = not big.done()
        release.set()
        big = big.result()
    assert health.status_code == 200
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2, small.text
    assert still_held and released == [True]
    assert big.status_code == 200 and big.json()["tokens"] == encode(held)


def test_a_prompt_too_long_in_any_tokenization_is_refused_before_tokenizing(http):
    """More characters than max_model_len tokens can hold (its longest piece each, doubled): 400 naming the
    prompt, without the seconds of tokenizing that could only end in that 400."""
    huge = "All work and no play makes Jack a dull boy. " * 90_000  # ~4 MB, under the default body limit
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        response = http.post(path, json={"model": MODEL, "max_tokens": 2, **body})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and "characters" in error["message"] and "256 tokens" in error["message"]


def test_fields_not_honoured_are_refused_and_stop_token_ids_range_checked(http):
    """Through the server: a constraint pagellm would ignore is a 400 naming it; a stop token or logit_bias id
    past the vocabulary is a 400 like a prompt id."""
    for body, param in (({"logit_bias": {"999999999": 10}}, "logit_bias"), ({"best_of": 3}, "best_of"),
                        ({"allowed_token_ids": [1]}, "allowed_token_ids"),
                        ({"stop_token_ids": [10**9]}, "stop_token_ids")):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_logit_bias_and_min_tokens_through_the_server(client, expected):
    """-100 on the greedy first token changes the output; min_tokens outlasts an answer that would end on EOS."""
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                       logit_bias={str(_token_id(client, first.choices[0].text)): -100})
    assert banned.choices[0].text != expected.choices[0].text
    assert not banned.choices[0].text.startswith(first.choices[0].text)
    # ignore_eos off: EOS and stop_token_ids end the output, except before min_tokens
    stop = _token_id(client, first.choices[0].text)
    ended = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3


def _token_id(client, text: str) -> int:
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    (token,) = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()[
        "tokens"]
    return token


def test_answers_match_the_published_response_models(http):
    """Every answer shape validates against the models /openapi.json publishes (extra fields forbidden)."""
    from pagellm.server import openapi
    from tests.server.server_harness import sse_events

    schema = http.get("/openapi.json").json()
    post = schema["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatCompletionChunk", "ErrorResponse"} <= set(
        schema["components"]["schemas"])

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    openapi.ChatCompletion.model_validate(http.post("/v1/chat/completions", json={
        **chat, "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1, "n": 2}).json())
    openapi.Completion.model_validate(http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "prompt_logprobs": 1}).json())
    for path, body, model in (("/v1/chat/completions", {**chat, "logprobs": True}, openapi.ChatCompletionChunk),
                              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}, openapi.Completion)):
        with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and len(events) > 3
        for event in events[:-1]:
            model.model_validate(event)
    openapi.ErrorResponse.model_validate(http.post("/v1/completions", json={"prompt": 5}).json())
    openapi.ModelList.model_validate(http.get("/v1/models").json())
    tokens = openapi.Tokens.model_validate(http.post("/tokenize", json={"prompt": PROMPT}).json())
    openapi.Detokenized.model_validate(http.post("/detokenize", json={"tokens": tokens.tokens}).json())
