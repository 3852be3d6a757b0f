"""Structured output through LLM.generate on the embedded Gemma 3 270M: every output matches its grammar, rows
without one are untouched, and a preempted request resumes its grammar where it was."""

import json
import re

import jsonschema
import pytest

from pagellm import LLM, SamplingParams
from pagellm.runner.model_runner import kv_cache_bytes_per_block
from pagellm.sampling_params import StructuredOutputs

# Bounded, so that even sampling at temperature 1 ends well inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
        "capital": {"type": "boolean"},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["city", "country", "population_millions", "capital", "rivers"],
    "additionalProperties": False,
}
PROMPT = "Describe Paris as a JSON object:"
PLAIN = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(embedded_llm):
    return embedded_llm  # the session's (tests/conftest.py), which tests/test_llm.py uses too


def json_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_outputs=StructuredOutputs(json=SCHEMA), **kwargs)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    params = [json_params(temperature=0.0)] + [json_params(temperature=1.0, seed=s) for s in range(6)]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({o.outputs[0].text for o in outputs}) > 1  # sampling still samples inside the grammar


@pytest.mark.parametrize("spec, check", [
    (StructuredOutputs(regex=r"\d{3}-[a-z]{2,4}"), lambda text: re.fullmatch(r"\d{3}-[a-z]{2,4}", text)),
    (StructuredOutputs(choice=["yes", 'a "quoted" \\ no', "peut-être"]),
     lambda text: text in ("yes", 'a "quoted" \\ no', "peut-être")),
    (StructuredOutputs(grammar='root ::= "(" [0-9]+ ")" | "none"'), lambda text: re.fullmatch(r"\(\d+\)|none", text)),
    (StructuredOutputs(json_object=True), lambda text: isinstance(json.loads(text), dict)),
])
def test_regex_choice_grammar_and_any_json_object(llm, spec, check):
    params = [SamplingParams(max_tokens=200, temperature=t, seed=3, structured_outputs=spec) for t in (0.0, 0.7)]
    prompt = 'Answer in JSON with one key "answer". What is 2+2?'  # a free JSON object needs a short question
    for out in llm.generate([prompt, prompt], params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


def test_rows_without_a_grammar_are_untouched(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    alone = [o.outputs[0].token_ids for o in llm.generate(PLAIN, greedy, use_tqdm=False)]
    mixed = llm.generate([PLAIN[0], PROMPT, PLAIN[1], PROMPT], [greedy, json_params(temperature=0.0), greedy,
                                                                 json_params(temperature=1.0, seed=1)], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_preempted_requests_resume_their_grammar(llm):
    """A pool too small for all at once: requests are preempted mid-JSON and their matchers replay the tokens."""
    params = json_params(temperature=0.0)
    reference = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    per_block = kv_cache_bytes_per_block(llm.engine.model, 16, llm.engine.kv_cache_dtype)
    small = LLM(kv_cache_memory=7 * per_block / 2**30, max_model_len=112)  # 4 requests of ~3 blocks each
    outputs = small.generate([PROMPT] * 4, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0, reference
    assert [o.outputs[0].text for o in outputs] == [reference] * 4


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "nonsense"}), "structured_outputs.json does not compile: .*nonsense"),
    (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex does not compile"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "structured_outputs.grammar does not compile"),
])
def test_a_grammar_that_does_not_compile_is_a_value_error(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert llm.stats()["num_requests_waiting"] == 0


def test_ignore_eos_needs_a_stop_token_id(llm):
    with pytest.raises(ValueError, match="ignore_eos"):
        llm.generate(PROMPT, json_params(ignore_eos=True), use_tqdm=False)
    eos = sorted(llm.engine.eos_token_ids)[0]
    out = llm.generate(PROMPT, json_params(ignore_eos=True, stop_token_ids=[eos], temperature=0.0), use_tqdm=False)
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMA)


def test_a_row_whose_grammar_refuses_its_token_fails_alone(llm, monkeypatch):
    """The runner's per-row failure path: the other rows' tokens of that step stand."""
    from pagellm.runner.grammar import RowGrammar

    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    alone = [o.outputs[0].token_ids for o in llm.generate(PLAIN, greedy, use_tqdm=False)]
    accept = RowGrammar.accept
    monkeypatch.setattr(RowGrammar, "accept", lambda self, token: False if len(self.stop_ids) == 1 else
                        accept(self, token))  # the request with one stop id (below) refuses its first token
    eos = sorted(llm.engine.eos_token_ids)[0]
    odd = json_params(temperature=0.0, ignore_eos=True, stop_token_ids=[eos])
    outputs = llm.generate([PLAIN[0], PROMPT, PLAIN[1]], [greedy, odd, greedy], use_tqdm=False)
    assert outputs[1].error is not None and "outside its grammar" in outputs[1].error
    assert outputs[1].outputs[0].finish_reason == "abort"
    assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == alone
    assert llm.stats()["kv_blocks_used"] == 0
