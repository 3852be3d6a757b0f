"""Embedding requests (SamplingParams.pooling, runner/pooling.py): the pooled final hidden states against HF
transformers' last_hidden_state on a tiny checkpoint written with save_pretrained, whatever the chunking, beside
generation requests in the same steps, with the prefix cache on; their blocks return to the pool."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import write_tiny_checkpoint

PROMPTS = [[5, 9, 17, 3, 8, 22, 41, 7, 13, 2, 30, 11], [5, 9, 17, 3], list(range(3, 40))]
MODES = ("mean", "last", "cls")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("embed-llama")
    return directory, write_tiny_checkpoint("llama", directory)


def _llm(directory, chunk: int) -> LLM:
    return LLM(model=str(directory), dtype="float32", quantization="none", skip_tokenizer_init=True,
               kv_cache_memory=0.02, max_model_len=128, max_num_batched_tokens=chunk)


@pytest.fixture(scope="module")
def whole(checkpoint):
    with _llm(checkpoint[0], 256) as llm:
        yield llm


@pytest.fixture(scope="module")
def chunked(checkpoint):
    with _llm(checkpoint[0], 8) as llm:  # the 37-token prompt runs in five chunks, across steps
        yield llm


def _hf_pooled(model, ids: list[int], mode: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, E], after the final norm
    return {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[mode]


@pytest.mark.parametrize("mode", MODES)
def test_pooled_hidden_states_are_hf_transformers_whatever_the_chunks(checkpoint, whole, chunked, mode):
    expected = [_hf_pooled(checkpoint[1], ids, mode) for ids in PROMPTS]
    for llm in (whole, chunked):
        got = [torch.tensor(v) for v in llm.embed(PROMPTS, pooling=mode, normalize=False, use_tqdm=False)]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-4)
    unit = whole.embed(PROMPTS[:1], pooling=mode, use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(unit), torch.nn.functional.normalize(expected[0], dim=0), atol=1e-5,
                               rtol=1e-4)


def test_beside_generation_with_the_prefix_cache_and_blocks_freed(chunked):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = chunked.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids  # caches its blocks
    embedded = chunked.embed([PROMPTS[2]], pooling="mean", normalize=False, use_tqdm=False)[0]  # never reads them
    mixed = chunked.generate([PROMPTS[2], PROMPTS[0], PROMPTS[2]],
                             [greedy, SamplingParams(max_tokens=1, pooling="mean"), SamplingParams(pooling="mean")],
                             use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone and mixed[0].embedding is None
    assert mixed[2].embedding == pytest.approx(embedded, abs=1e-6)
    assert mixed[1].outputs[0].token_ids == [] and mixed[1].outputs[0].finish_reason == "stop"
    stats = chunked.stats()
    assert stats["kv_blocks_used"] == 0, stats  # every block back in the pool (cached ones are free)
    assert not chunked.engine.has_unfinished_requests() and not chunked.engine.scheduler.running


def test_async_scheduling_gives_the_same_embeddings_and_tokens(checkpoint, chunked):
    """A step launched before the last one's outputs are read must neither schedule a finished prompt again nor
    lose its vector."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    params = [greedy, SamplingParams(pooling="mean"), greedy, SamplingParams(pooling="last"), greedy,
              SamplingParams(pooling="cls")]
    expected = [(o.outputs[0].token_ids, o.embedding) for o in chunked.generate(PROMPTS * 2, params, use_tqdm=False)]
    with LLM(model=str(checkpoint[0]), dtype="float32", quantization="none", skip_tokenizer_init=True,
             kv_cache_memory=0.02, max_model_len=128, max_num_batched_tokens=8, async_scheduling=True) as llm:
        outputs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
        assert llm.stats()["async_scheduling"] and llm.stats()["kv_blocks_used"] == 0
    assert [(o.outputs[0].token_ids, o.embedding) for o in outputs] == expected


def test_pooling_must_be_a_known_mode():
    with pytest.raises(ValueError, match="pooling must be one of mean, last, cls"):
        SamplingParams(pooling="max")
