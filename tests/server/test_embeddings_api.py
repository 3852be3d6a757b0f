"""POST /v1/embeddings (server/embeddings.py) through the official openai client: vectors of the served model's
width, unit length by default, the same for an input alone or in a batch, as floats or base64; its 400s."""

from __future__ import annotations

import base64
import math
import struct

import pytest

MODEL = "gemma-3-270m"


def _cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_an_input_gives_a_unit_vector_of_the_models_width(client, http):
    answer = client.embeddings.create(model=MODEL, input="The capital of France is Paris.")
    (item,) = answer.data
    assert (answer.object, item.object, item.index, len(item.embedding)) == ("list", "embedding", 0, 640)
    assert math.sqrt(sum(x * x for x in item.embedding)) == pytest.approx(1.0, abs=1e-5)
    tokens = http.post("/tokenize", json={"prompt": "The capital of France is Paris."}).json()["count"]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens


def test_a_batch_keeps_its_order_and_each_vector(client, http):
    texts = ["The capital of France is Paris.", "def f(x): return x", "Paris is the capital of France."]
    ids = http.post("/tokenize", json={"prompt": texts[1]}).json()["tokens"]
    batch = client.embeddings.create(model=MODEL, input=[texts[0], texts[1], texts[2]]).data
    alone = [client.embeddings.create(model=MODEL, input=text).data[0].embedding for text in texts]
    by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
    assert [item.index for item in batch] == [0, 1, 2]
    for item, single in zip(batch, alone):
        assert _cosine(item.embedding, single) > 0.999  # batched rows may round differently in bf16
    assert _cosine(by_ids, alone[1]) > 0.9999
    assert _cosine(alone[0], alone[2]) > _cosine(alone[0], alone[1])  # the paraphrase is nearer than the code


def test_base64_is_the_float32_bytes_and_normalize_false_keeps_the_length(http):
    body = {"model": MODEL, "input": "hello world"}
    floats = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    encoded = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(encoded))
    assert decoded == pytest.approx(floats, abs=1e-7)
    raw = http.post("/v1/embeddings", json={**body, "normalize": False}).json()["data"][0]["embedding"]
    norm = math.sqrt(sum(x * x for x in raw))
    assert norm != pytest.approx(1.0, abs=1e-3) and [x / norm for x in raw] == pytest.approx(floats, abs=1e-5)


def test_more_inputs_than_the_queue_ever_holds_is_a_400_not_a_429(http):
    answer = http.post("/v1/embeddings", json={"input": [[2, 9]] * 1025})  # the default --max-waiting is 1024
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input", answer.text


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 64}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": "x", "add_special_tokens": False}, "add_special_tokens"),
])
def test_what_it_cannot_do_is_a_400_naming_the_field(http, body, param):
    answer = http.post("/v1/embeddings", json=body)
    status = 404 if param == "model" else 400  # an unknown model is OpenAI's 404
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
