"""End-to-end tests of LLM.generate on the embedded Gemma 3 270M with default settings (the GGUF's blocks as
stored, the level's dtype); against HF transformers, the dense fp32 model of the same file."""

import json
import os
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.bench.peers import transformers_config
from pagellm.loader.model_loader import checkpoint_state_dict

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def llm(embedded_llm):
    return embedded_llm  # the session's (tests/conftest.py): its pool holds one max_model_len (4096) sequence


@pytest.fixture(scope="module")
def reference_ids(llm):
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_output_shape_is_vllms(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert len(out) == 1
    first = out[0]
    assert first.prompt == "The capital of France is"
    assert first.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    completion = first.outputs[0]
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
    assert completion.text == llm.tokenizer.decode(completion.token_ids)


# HF transformers' greedy ids on the dense fp32 model of the embedded GGUF, recorded by the test below (which
# runs HF live at the CPU's own level and fails if they no longer match): the lower levels compare with these,
# sparing a 270M-parameter HF generate in fp32 per level. Regenerate: PAGELLM_RECORD_HF_IDS=1 pytest -k live_hf
HF_IDS = Path(__file__).parent / "hf_greedy_ids.json"


@pytest.fixture(scope="module")
def dense():
    return LLM(kv_cache_memory=0.05, dtype="float32", quantization="none", max_model_len=1024)


def test_greedy_matches_live_hf_transformers_on_the_same_gguf(dense, hf_gemma3_of_the_embedded_model):
    """HF's Gemma3ForCausalLM, given the GGUF's weights (checked against transformers' own GGUF
    conventions in tests/loader/test_default_model.py), generates the same greedy ids as the dense fp32 model,
    and the recorded ids (HF_IDS) are still HF's."""
    import torch

    ids_of_ours = [out.outputs[0].token_ids for out in dense.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
    hf = hf_gemma3_of_the_embedded_model  # the session's (tests/conftest.py), in the config of ours:
    assert hf.config.to_dict() == {**transformers_config(dense.engine.hf_config).to_dict(), "dtype": "float32"}
    missing, unexpected = hf.load_state_dict(checkpoint_state_dict(dense.engine.model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    hf.tie_weights()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ids_of_hf = []
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([dense.tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        ids_of_hf.append(out[0, ids.shape[1]:].tolist())
    if os.environ.get("PAGELLM_RECORD_HF_IDS") == "1":
        HF_IDS.write_text(json.dumps({"prompts": PROMPTS[:3], "ids": ids_of_hf}) + "\n")
    assert ids_of_ours == ids_of_hf
    assert json.loads(HF_IDS.read_text()) == {"prompts": PROMPTS[:3], "ids": ids_of_hf}  # the record is HF's


def test_greedy_matches_recorded_hf_ids(dense):
    """The same comparison against HF's ids as recorded (the live test above keeps the record true)."""
    recorded = json.loads(HF_IDS.read_text())
    assert [out.outputs[0].token_ids for out in dense.generate(recorded["prompts"], GREEDY, use_tqdm=False)] == \
        recorded["ids"]


def test_token_id_prompts_equal_string_prompts(llm, reference_ids):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    out = llm.generate(ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference_ids[:2]
    assert out[0].prompt is None and out[0].prompt_token_ids == ids[0]


def test_batch_equals_one_at_a_time(llm, reference_ids):
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert alone == reference_ids


@pytest.mark.parametrize("kwargs", [
    {"enable_prefix_caching": False},
    {"block_size": 32},
    {"max_num_batched_tokens": 64, "n_ubatch": 16},
    {"enable_prefix_caching": False, "block_size": 32, "max_num_batched_tokens": 64, "n_ubatch": 16},
], ids=["prefix-cache-off", "block-32", "chunked-prefill-64", "all-three"])  # all-three: the lower levels' one run
def test_greedy_ids_identical_across_engine_settings(kwargs, reference_ids):
    other = LLM(kv_cache_memory=0.25, max_model_len=4096, **kwargs)
    out = other.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference_ids


def test_shared_prefix_is_computed_once_and_output_unchanged(llm):
    system = "You are a helpful assistant that answers questions about geography concisely. " * 6
    prompts = [system + q for q in ("Where is Peru?", "Where is Chad?", "Where is Laos?", "Where is Fiji?")]
    before = llm.stats()
    shared = llm.generate(prompts, GREEDY, use_tqdm=False)
    after = llm.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in shared)
    computed = after["computed_prefill_tokens"] - before["computed_prefill_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    ids = [o.prompt_token_ids for o in shared]
    common = next(i for i in range(len(ids[0])) if len({tuple(x[: i + 1]) for x in ids}) > 1)
    assert common >= 64
    assert hits == 3 * (common // 16 * 16)  # the three followers reuse every full block of the shared prefix
    assert computed == prompt_tokens - hits
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in shared] == alone


def test_stop_strings_and_stop_token_ids(llm, reference_ids):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text.strip().split()[1]  # the second word of the greedy continuation
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert stop not in c.text and text.startswith(c.text)
    ids = reference_ids[0]
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])  # a token that first appears at j
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids[j]]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids[: j + 1] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == ids[j]


def test_seed_reproducible_whatever_else_runs(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    busy = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]],
                        [SamplingParams(max_tokens=15, temperature=0.8), params, GREEDY], use_tqdm=False)
    assert busy[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=1.0, seed=99),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    entries = out.outputs[0].logprobs
    assert len(entries) == 3
    for token, entry in zip(out.outputs[0].token_ids, entries):
        assert entry.token_id == token and entry.rank == 1  # greedy picks the most likely
        assert len(entry.top) == 3 and entry.top[0][0] == token
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_ignore_eos_and_max_tokens(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**9]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is"):  # longer than max_model_len (4096): no engine of its own
        llm.generate("a " * 5000, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_no_block_leaks_after_generate_and_abort(llm):
    rid = llm.engine.add_request("abort me please", SamplingParams(max_tokens=50, ignore_eos=True))  # no early stop
    llm.engine.step()
    assert llm.stats()["kv_blocks_used"] > 0
    assert llm.engine.abort(rid)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0


def test_preemption_recomputes_and_keeps_greedy_ids(llm, reference_ids):
    """A KV pool too small for every request at once: requests are preempted and resumed, output unchanged."""
    from pagellm.runner.model_runner import kv_cache_bytes_per_block

    per_block = kv_cache_bytes_per_block(llm.engine.model, 16, llm.engine.kv_cache_dtype)
    small = LLM(kv_cache_memory=6 * per_block / 2**30, max_model_len=96)  # 6 blocks for 5 requests needing 2 each
    assert small.stats()["kv_blocks_total"] == 6
    out = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference_ids
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0


def test_min_tokens_and_logit_bias_through_the_engine(llm, reference_ids):
    """min_tokens keeps a stop token id from ending the output early; a +100 bias forces its token."""
    ids = reference_ids[0]
    stop = ids[0]  # the greedy first token: a stop id that would end the output at once
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop],
                                                  min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and stop not in out.token_ids[:3]  # the third token may not stop it either
    pushed = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop],
                                                     min_tokens=3, logit_bias={stop: 100}), use_tqdm=False)
    pushed = pushed[0].outputs[0].token_ids  # the stop forced by its bias, banned for the first three tokens
    assert len(pushed) == 4 and stop not in pushed[:3] and pushed[3] == stop
    forced = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={"818": 100}),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [818, 818, 818]
    with pytest.raises(ValueError, match="logit_bias token ids out of range"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**9: 1}), use_tqdm=False)
