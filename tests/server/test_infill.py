"""POST /infill (server/infill.py): the prompt laid out as llama-server's format_prompt_infill, the FIM tokens found
as llama.cpp finds them, llama-server's answer shape; a model without FIM tokens gets a 400."""

from __future__ import annotations

import signal

import httpx
import pytest

from pagellm.loader.tokenizer import load_tokenizer
from pagellm.server.infill import InfillRequest, fim_ids, infill_tokens
from tests.loader.gguf_builders import write_tiny_gguf
from tests.loader.test_tokenizer import TINY_VOCAB
from tests.server.server_harness import BASE_ARGS, sse_events, start_server, stop_with

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def fim_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("fim") / "fim.gguf", "llama", vocab=TINY_VOCAB + FIM).path


@pytest.fixture(scope="module")
def fim_server(fim_gguf, tmp_path_factory):
    server = start_server([str(fim_gguf), *BASE_ARGS], tmp_path_factory.mktemp("fim-serve"))
    yield server
    stop_with(server, signal.SIGINT)


def _request(**fields) -> InfillRequest:
    return InfillRequest.model_validate({"input_prefix": "hello", "input_suffix": "world", **fields})


def test_the_prompt_is_laid_out_as_llama_server_does(fim_gguf, tmp_path):
    tok = load_tokenizer(fim_gguf, tmp_path)
    pre, suf, mid, rep, sep = (tok.token_id(t) for t in FIM)

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    request = _request(prompt=" he", input_extra=[{"filename": "a.py", "text": "world"}])
    expected = ([rep, *enc("myproject\n"), sep, *enc("a.py\n"), *enc("world"), sep, *enc("filename\n")]
                + [tok.bos_token_id, pre, *enc("hello"), *enc(" he"), suf, *enc("world"), mid])
    assert infill_tokens(tok, request, n_ctx=8192, n_predict=16) == expected
    # a small context leaves no room for extra context (n_ctx - batch - 2 * n_predict < 0), as in llama-server
    assert infill_tokens(tok, request, n_ctx=256, n_predict=16) == expected[expected.index(tok.bos_token_id):]
    # special-token text in the code is code, as llama-server tokenizes it (parse_special false): one FIM_MID
    written = infill_tokens(tok, _request(input_prefix="hello <|fim_middle|>"), n_ctx=256, n_predict=16)
    assert written.count(mid) == 1 and written[-1] == mid
    long_prefix = infill_tokens(tok, _request(input_prefix="hello " * 2000), n_ctx=256, n_predict=16)
    assert long_prefix[2:2 + 1536] == enc("hello " * 2000)[-1536:] and long_prefix[2 + 1536] == suf


def test_without_repo_and_file_tokens_extra_chunks_are_snippets(tmp_path):
    path = write_tiny_gguf(tmp_path / "fim3.gguf", "llama", vocab=TINY_VOCAB + FIM[:3]).path
    tok = load_tokenizer(path, tmp_path)
    ids = infill_tokens(tok, _request(input_extra=[{"text": "world"}]), n_ctx=8192, n_predict=0)
    snippet = tok.encode("\n\n--- snippet ---\n\n", add_special_tokens=False)
    assert ids[:len(snippet)] == snippet and tok.decode(ids[:ids.index(tok.bos_token_id)]).endswith("world")


def test_the_files_fim_ids_come_before_texts(tmp_path):
    def stated(writer):  # the file says the middle token is "▁hello" (whatever its text)
        writer.add_uint32("tokenizer.ggml.fim_mid_token_id", TINY_VOCAB.index("▁hello"))

    path = write_tiny_gguf(tmp_path / "stated.gguf", "llama", vocab=TINY_VOCAB + FIM, extra_metadata=stated).path
    assert fim_ids(load_tokenizer(path, tmp_path))["mid"] == TINY_VOCAB.index("▁hello")


def test_infill_answers_as_llama_server_whole_and_streamed(fim_server, fim_gguf, tmp_path):
    body = {"input_prefix": "hello", "input_suffix": "world", "prompt": " he", "n_predict": 4, "temperature": 0.0,
            "ignore_eos": True, "cache_prompt": True, "t_max_predict_ms": 500}
    with httpx.Client(base_url=fim_server.url, timeout=60) as http:
        whole = http.post("/infill", json=body)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        expected_prompt = infill_tokens(load_tokenizer(fim_gguf, tmp_path), _request(prompt=" he"), 256, 4)
        assert (answer["stop"], answer["stop_type"], answer["tokens_predicted"]) == (True, "limit", 4)
        assert answer["tokens_evaluated"] == len(expected_prompt) and isinstance(answer["content"], str)
        with http.stream("POST", "/infill", json={**body, "stream": True}) as streamed:
            events = sse_events(streamed.iter_lines())
        assert events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
        assert "".join(e["content"] for e in events) == answer["content"]
        missing = http.post("/infill", json={"input_prefix": "x"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "input_suffix"
        negative = http.post("/infill", json={**body, "n_predict": -2})
        assert negative.status_code == 400 and negative.json()["error"]["param"] == "n_predict"
        for field, value in (("grammar", "root ::= \"x\""), ("json_schema", {}), ("n", 2), ("logprobs", 2),
                             ("stream_options", {"include_usage": True})):
            refused = http.post("/infill", json={**body, field: value})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (field, refused.text)


def test_a_model_without_fim_tokens_is_a_400_naming_them(http):
    answer = http.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):\n"})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "input_prefix"
    assert "no fill-in-the-middle prefix, suffix, middle token" in error["message"]
