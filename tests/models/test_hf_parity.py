"""Every family against HF transformers (eager, fp32) on a tiny random checkpoint read back from disk.

The checkpoint goes through the real loader: load_hf_config + build_model (meta
device) + iter_safetensors_weights. Our side always runs over a paged KV cache
with shuffled block ids (see paged_harness).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import hf_greedy, hf_logits, load_ours, random_tokens
from tests.models.paged_harness import PagedHarness, greedy_generate
from tests.models.tiny_checkpoints import TINY_CONFIGS, write_tiny_checkpoint


TOL = dict(atol=1e-4, rtol=1e-4)
PROMPT_LEN = 20  # longer than the sliding window (8) and spanning 5 blocks of 4


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def hf_and_ours(request, tmp_path_factory):
    """(HF model, pagellm model) with the same weights, one pair per family."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_checkpoint(request.param, path)
    return hf_model, load_ours(path)


def test_prompt_logits_match_hf(hf_and_ours):
    hf_model, model = hf_and_ours
    prompt = random_tokens(PROMPT_LEN, seed=0)
    torch.testing.assert_close(PagedHarness(model).prefill("a", prompt), hf_logits(hf_model, prompt), **TOL)


def test_greedy_continuation_matches_hf_generate(hf_and_ours):
    hf_model, model = hf_and_ours
    prompt = random_tokens(PROMPT_LEN, seed=1)
    expected = hf_greedy(hf_model, prompt, 8)
    assert len(expected) == 8
    assert greedy_generate(model, prompt, max_new_tokens=8) == expected


def test_chunked_prefill_and_decode_match_one_forward(hf_and_ours):
    _, model = hf_and_ours
    prompt = random_tokens(PROMPT_LEN, seed=2)
    whole = PagedHarness(model).prefill("a", prompt)
    chunked = PagedHarness(model, seed=1).prefill("a", prompt, chunk_size=7)
    torch.testing.assert_close(chunked, whole, **TOL)
    harness = PagedHarness(model, seed=2)
    decoded = [harness.prefill("a", prompt[:12])] + [harness.step({"a": [t]})["a"] for t in prompt[12:]]
    torch.testing.assert_close(torch.cat(decoded), whole, **TOL)


def test_mixed_batch_matches_each_sequence_alone(hf_and_ours):
    _, model = hf_and_ours
    a, b = random_tokens(PROMPT_LEN, seed=3), random_tokens(17, seed=4)
    alone_a, alone_b = PagedHarness(model).prefill("a", a), PagedHarness(model).prefill("b", b)
    harness = PagedHarness(model, seed=5)
    steps = [
        {"a": a[:12], "b": b[:13]},  # two prefills of different lengths
        {"a": a[12:13], "b": b[13:16]},  # a decode next to a prefill chunk
        {"a": a[13:14], "b": b[16:17]},  # pure decode, contexts 14 and 17
        {"a": a[14:]},
    ]
    outputs = [harness.step(step) for step in steps]
    torch.testing.assert_close(torch.cat([out["a"] for out in outputs]), alone_a, **TOL)
    torch.testing.assert_close(torch.cat([out["b"] for out in outputs if "b" in out]), alone_b, **TOL)
