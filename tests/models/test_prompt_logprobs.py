"""prompt_logprobs through the offline LLM: every prompt position against HF transformers' fp32 log-softmax,
whatever the chunking, and with the prefix cache holding the prompt."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.types import PromptLogprobs, TokenLogprobs
from pagellm.output_processor import RequestState
from pagellm.request import Request
from tests.models.hf_reference import hf_logits, random_tokens
from tests.models.tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 3 (sliding window 8, logit soft-cap) and its HF model."""
    path = tmp_path_factory.mktemp("gemma3")
    return path, write_tiny_checkpoint("gemma3", path)


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", quantization="none", block_size=4, kv_cache_memory=0.01,
               skip_tokenizer_init=True, **kwargs)  # fp32 dense: compared with HF's fp32


def _check_against_hf(prompt_logprobs, prompt: list[int], hf_model, k: int) -> None:
    reference = hf_logits(hf_model, prompt).log_softmax(-1)  # [L, V] fp32
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        scored, row, token = prompt_logprobs[position], reference[position - 1], prompt[position]
        assert scored[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert scored[token].rank == int((row > row[token]).sum()) + 1
        assert scored[token].decoded_token is None  # no tokenizer
        top = row.topk(k)
        ranked = sorted((lp.rank, t) for t, lp in scored.items() if lp.rank <= k)  # the top-k, best first
        assert [t for _, t in ranked] == top.indices.tolist()
        assert set(scored) == set(top.indices.tolist()) | {token}  # k entries, or k + 1 beside the prompt's
        for t, value in zip(top.indices.tolist(), top.values.tolist()):
            assert scored[t].logprob == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-chunk", "chunked-16"])
def test_prompt_logprobs_equal_hf_log_softmax(gemma, budget):
    path, hf_model = gemma
    llm = _llm(path, max_num_batched_tokens=budget, n_ubatch=16)
    prompts = [random_tokens(37, seed=1), random_tokens(9, seed=2), random_tokens(21, seed=3)]
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2),
              SamplingParams(max_tokens=3, temperature=0.0),  # batched beside them, asks for nothing
              SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check_against_hf(outs[0].prompt_logprobs, prompts[0], hf_model, k=2)
    assert outs[1].prompt_logprobs is None
    _check_against_hf(outs[2].prompt_logprobs, prompts[2], hf_model, k=0)
    alone = _llm(path).generate(prompts[1:2], params[1], use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs(gemma):
    path, hf_model = gemma
    llm = _llm(path, max_num_batched_tokens=16, n_ubatch=16)
    prompt = random_tokens(30, seed=4)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0]
    scored = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # the prefix cache held 28 of its tokens
    _check_against_hf(scored.prompt_logprobs, prompt, hf_model, k=1)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 28 and again.prompt_logprobs is None  # other requests still hit


def test_one_token_prompt_has_only_the_leading_none(gemma):
    path, _ = gemma
    out = _llm(path).generate([[5]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3),
                              use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_prompt_recomputed_after_a_preemption_keeps_each_position_once():
    state = RequestState(Request("r", list(range(10)), SamplingParams(prompt_logprobs=0), 4), None, None)

    def chunk(first: int, last: int) -> PromptLogprobs:
        return PromptLogprobs("r", first, tuple(TokenLogprobs(i, -float(i), 1) for i in range(first, last + 1)))

    for part in (chunk(1, 4), chunk(1, 4), chunk(5, 8), chunk(5, 9)):  # preempted after the first chunk
        state.add_prompt_logprobs(part)
    out = state.make_output(None)
    assert [None if d is None else list(d) for d in out.prompt_logprobs] == [None] + [[i] for i in range(1, 10)]
    with pytest.raises(RuntimeError, match="skip"):
        RequestState(Request("s", list(range(10)), SamplingParams(prompt_logprobs=0), 4), None,
                     None).add_prompt_logprobs(chunk(3, 4))


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_prompt_logprobs_out_of_range_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
