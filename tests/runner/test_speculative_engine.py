"""Speculative decoding through the engine (core/speculative.py, runner/speculative.py): every family gives the
greedy ids it gives without it (accepted and rejected drafts both, hybrid state rolled back), a seeded request
its very tokens under every sampling field, and the block pool and prefix cache end as they would without it.
At every instruction-set level (tests/lower_levels.py repeats tests/runner)."""

from __future__ import annotations

import json

import pytest

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# Prompts that repeat themselves, so that lookups find proposals from the first decode on.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 11], [20, 21, 22, 23, 24, 25, 20, 21],
           [3, 4] * 9]


def _greedy(n: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **fields)


def _generate(path, prompts, params, speculative=None, **engine_args):
    """-> (token ids, finish reasons, stats) of one batch."""
    with LLM(str(path) if path else None, skip_tokenizer_init=path is not None, speculative_config=speculative,
             **{"kv_cache_memory": 0.01, "block_size": 4, **engine_args}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs], llm.stats()


def _check_identical(path, prompts, params, **engine_args):
    plain, plain_reasons, _ = _generate(path, prompts, params, **engine_args)
    spec, spec_reasons, stats = _generate(path, prompts, params, NGRAM, **engine_args)
    assert spec == plain and spec_reasons == plain_reasons
    # both outcomes happened: drafts accepted (tokens emitted past the decode's) and drafts rejected (rolled back)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert stats["spec_mean_accepted_length"] > 1.0
    return stats


TINY = ["llama", "mistral", "qwen2", "qwen3-yarn", "gemma3"]
HYBRID = ["qwen3-moe", "qwen3-next", "qwen3.5", "qwen3.5-moe"]


@pytest.mark.parametrize("family", TINY + HYBRID)
def test_greedy_ids_identical_with_speculation_for_every_family(tmp_path, family):
    """Four requests at once, blocks of 4 tokens (drafts cross block boundaries), prefix caching on (hybrid
    models: state snapshots too), chunked prefill: the ids of a run without speculation."""
    if family in HYBRID:
        write_hybrid_checkpoint(family, tmp_path)
    else:
        write_tiny_checkpoint(family, tmp_path, redraw=True)
    _check_identical(tmp_path, PROMPTS, _greedy(24), max_num_batched_tokens=16, n_ubatch=8)


def test_greedy_ids_identical_on_the_embedded_model_with_the_default_adaptive_length():
    """The GGUF as stored, its own tokenizer: a text that repeats, adaptive draft lengths (the default)."""
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
    params = _greedy(32)
    plain, _, _ = _generate(None, [prompt, "The capital of France is"], params)
    spec, _, stats = _generate(None, [prompt, "The capital of France is"], params, {"num_speculative_tokens": 4})
    assert spec == plain and stats["spec_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint("llama", path, redraw=True)
    return path


def test_a_seeded_request_emits_its_own_tokens_under_every_sampling_field(checkpoint):
    """Row i of a verify step is sampled as the request's next token would be after i accepted drafts: its
    seeded stream i, penalties and min_tokens counting the drafts, logit_bias; so the emitted tokens are the
    very ones drawn without speculation (a biased acceptance rule would change them), and so are the logprobs of
    each."""
    fields = [dict(temperature=0.9, top_k=20, top_p=0.9, seed=7),
              dict(temperature=0.7, seed=11, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
              dict(temperature=1.0, seed=3, min_p=0.05, logit_bias={9: 2.0, 5: 1.5}, logprobs=2),
              dict(temperature=0.0, min_tokens=10, stop_token_ids=[5, 6, 7, 8, 9], logprobs=1)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **f) for f in fields]
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01, block_size=4) as plain_llm:
        plain = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01, block_size=4,
             speculative_config=NGRAM) as spec_llm:
        spec = spec_llm.generate(PROMPTS, params, use_tqdm=False)
        stats = spec_llm.stats()
    assert stats["spec_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        if a.outputs[0].logprobs is not None:
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top])
                assert abs(x.logprob - y.logprob) < 1e-3


def test_stop_strings_max_tokens_and_context_end_requests_where_they_do_without():
    """A stop string, a stop token or max_tokens met inside a verify step's tokens ends the request at that
    token; the tokens after it are dropped (text, ids and finish reason as without speculation)."""
    prompt = "one two three four five one two three four five one two three"
    with LLM(kv_cache_memory=0.05) as llm:
        first = llm.generate([prompt], _greedy(24), use_tqdm=False)[0].outputs[0]
    words = first.text.split()
    stop = words[len(words) // 2] if len(words) > 2 else first.text[-3:]
    cases = [_greedy(24, stop=[stop]), _greedy(24, stop_token_ids=[first.token_ids[9]]), _greedy(7)]
    results = []
    for spec in (None, {"num_speculative_tokens": 5, "adaptive": False}):
        with LLM(kv_cache_memory=0.05, speculative_config=spec) as llm:
            outs = llm.generate([prompt] * 3, cases, use_tqdm=False)
            results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                             o.outputs[0].stop_reason) for o in outs])
            if spec:
                assert llm.stats()["spec_accepted_tokens"] > 0
    assert results[0] == results[1]
    assert results[1][0][2] == "stop" and results[1][2][2] == "length" and len(results[1][2][1]) == 7


def test_no_block_leaks_and_the_same_prefix_cache_after_many_requests_with_aborts(checkpoint):
    """Rejected drafts' KV is overwritten, never registered: after requests and aborts every block is free,
    and the prefix cache holds the blocks it holds without speculation."""
    params = [_greedy(6 + i % 7) for i in range(48)]
    prompts = [PROMPTS[i % len(PROMPTS)] + [30 + i % 5] * (i % 3) for i in range(48)]
    hashes = []
    for spec in (None, {**NGRAM, "disable_by_batch_size": 64}):
        with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01, block_size=4, max_num_seqs=16,
                 speculative_config=spec) as llm:
            llm.generate(prompts, params, use_tqdm=False)
            pool = llm.engine.kv_cache.pool
            assert pool.num_free_blocks == pool.num_blocks
            hashes.append(set(pool.cached))
            engine, aborted = llm.engine, 0
            for round_ in range(1000 // 50):
                ids = [engine.add_request(prompts[i % 48], params[i % 48]) for i in range(50)]
                for step in range(3 + round_ % 4):
                    engine.step()
                for rid in ids[::7]:
                    aborted += engine.abort(rid)
                while engine.has_unfinished_requests():
                    engine.step()
            assert aborted > 0 and pool.num_free_blocks == pool.num_blocks
            assert not engine.kv_cache.req_blocks and not engine.scheduler.requests
            if spec:
                assert llm.stats()["spec_verify_steps"] > 1000
    assert hashes[0] == hashes[1]


def test_speculation_stays_off_for_large_batches_and_within_the_token_budget(checkpoint):
    """disable_by_batch_size: a step with more decodes than it runs them plainly. Drafts come out of the step's
    token budget (max_num_batched_tokens), after every decode's own token."""
    spec = {**NGRAM, "disable_by_batch_size": 2}
    _, _, stats = _generate(checkpoint, PROMPTS, _greedy(6), spec)
    assert stats["spec_verify_steps"] == 0
    _, _, stats = _generate(checkpoint, PROMPTS[:2], _greedy(6), spec)
    assert stats["spec_verify_steps"] > 0
    with LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01, block_size=4, n_ubatch=4,
             max_num_batched_tokens=6, speculative_config={**NGRAM, "num_speculative_tokens": 8}) as llm:
        schedule, decode_steps = llm.engine.scheduler.schedule, []

        def recorded(proposals=None):
            output = schedule(proposals)
            if output.num_prefill_tokens == 0 and output.scheduled:
                decode_steps.append(output.num_decode_tokens)
            return output

        llm.engine.scheduler.schedule = recorded
        llm.generate(PROMPTS, _greedy(12), use_tqdm=False)
        assert llm.stats()["spec_accepted_tokens"] > 0
    assert decode_steps and max(decode_steps) <= 6


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle"}', "not supported; supported: ngram, draft_model, mtp"),
    ('{"method": "mtp", "num_speculative_tokens": 1.5}', "num_speculative_tokens must be in 1..64"),
    ('{"method": "draft_model"}', "names the draft model of method draft_model"),
    ('{"model": "x.gguf"}', "names the draft model of method draft_model"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in 1..64"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"n": 3}', "unknown key"),
    ("{not json", "not valid JSON"),
    ("[3]", "must be a JSON object"),
])
def test_a_bad_speculative_config_is_a_clear_error(value, message):
    from pagellm.cli import build_parser
    from pagellm.config import speculative_config_from

    with pytest.raises(ValueError, match=message):
        speculative_config_from(value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--speculative-config", value])


def test_the_flag_reaches_the_engine_config():
    from pagellm.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram", '
                                      '"num_speculative_tokens": 5, "prompt_lookup_max": 3}'])
    spec = engine_config_from_args(args).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 5, 3)
    assert engine_config_from_args(build_parser().parse_args(["serve"])).speculative is None


def test_structured_output_with_speculation_gives_the_same_json():
    """Row i of a verify step is masked by the grammar advanced over the first i drafts (a refused draft is then
    never accepted): greedy and seeded requests give the JSON they give without speculation, and drafts from an
    example in the prompt are accepted."""
    from pagellm.sampling_params import StructuredOutputs

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"type": "string", "maxLength": 12},
                                               "rivers": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 10},
                                                          "maxItems": 3}},
              "required": ["city", "country", "rivers"], "additionalProperties": False}
    prompt = ('{"city": "Rome", "country": "Italy", "rivers": ["Tiber", "Aniene"]}\n'
              '{"city": "Paris", "country": "France", "rivers": ["Seine", "Marne"]}\n')
    params = [SamplingParams(max_tokens=80, temperature=t, seed=4, structured_outputs=StructuredOutputs(json=schema))
              for t in (0.0, 0.8)]
    results = []
    for spec in (None, {"num_speculative_tokens": 6, "adaptive": False}):
        with LLM(kv_cache_memory=0.05, speculative_config=spec) as llm:
            outs = llm.generate([prompt] * 2, params, use_tqdm=False)
            results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
            if spec:
                assert llm.stats()["spec_accepted_tokens"] > 0
    assert results[0] == results[1]
    for text, _, reason in results[1]:
        assert reason == "stop" and set(json.loads(text)) == {"city", "country", "rivers"}


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    write_tiny_checkpoint("llama", path, seed=3, redraw=True)  # the same vocabulary, other weights
    return path


@pytest.mark.parametrize("target", ["llama", "qwen3.5"])
def test_a_draft_model_gives_the_targets_ids(tmp_path, checkpoint, other_llama, target):
    """method draft_model: the draft engine's greedy tokens verified like lookups. The target itself as its draft
    has every draft accepted; another model of the same vocabulary some or none: the ids are the target's either
    way (a hybrid target's state rolled back), seeded sampling included."""
    path = checkpoint
    if target == "qwen3.5":
        path = tmp_path
        write_hybrid_checkpoint("qwen3.5", path)
    params = [_greedy(20), SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)]
    plain, _, _ = _generate(path, PROMPTS[:2], params)
    for draft in (path, other_llama):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4, "adaptive": False}
        ids, _, stats = _generate(path, PROMPTS[:2], params, spec)
        assert ids == plain and stats["spec_verify_steps"] > 0
        if draft == path:  # the target proposing for itself: its greedy drafts all accepted
            greedy_only, _, stats = _generate(path, PROMPTS[:1], _greedy(20), spec)
            assert greedy_only[0] == plain[0] and stats["spec_acceptance_rate"] == 1.0


def test_a_draft_model_of_another_vocabulary_is_a_clear_error(tmp_path, checkpoint):
    from tests.models.tiny_checkpoints import TINY_CONFIGS

    config = TINY_CONFIGS["llama"]()
    config.vocab_size = 300
    write_tiny_checkpoint("llama", tmp_path, config=config)
    with pytest.raises(ValueError, match="speculative_config.model has a vocabulary of 300 tokens"):
        LLM(str(checkpoint), skip_tokenizer_init=True, kv_cache_memory=0.01,
            speculative_config={"method": "draft_model", "model": str(tmp_path)})
