"""`pagellm bench speculative`'s pieces: its workloads, the acceptance read from each server, the best round's
ratios (the servers themselves: tests/bench/test_bench_serve_compare.py runs the same Server orchestration)."""

from __future__ import annotations

import math

from pagellm.bench.speculative import _acceptance, _with_ratios, workloads


def test_workloads_are_fixed_texts_with_their_sampling(tmp_path):
    text = tmp_path / "license.txt"
    text.write_text("Title\n\nPreamble\n\nThe licenses for most software are designed to take away your freedom.")
    prompts = workloads(str(text))
    assert list(prompts) == ["code-edit", "summary", "prose"]
    assert "def dedent(text):" in prompts["code-edit"][0] and prompts["code-edit"][1]["temperature"] == 0.0
    assert prompts["summary"][0].startswith("Preamble") and prompts["summary"][1]["temperature"] == 0.0
    assert prompts["prose"][1]["temperature"] > 0 and prompts["prose"][1]["seed"] == 1


def test_acceptance_from_pagellm_counters_or_llama_server_timings():
    before = {"spec_decode_num_draft_tokens": 10, "spec_decode_num_drafts": 4, "spec_decode_num_accepted_tokens": 5}
    after = {"spec_decode_num_draft_tokens": 50, "spec_decode_num_drafts": 14, "spec_decode_num_accepted_tokens": 35}
    assert _acceptance(before, after, []) == {"acceptance": 0.75, "tokens_per_verify": 4.0}
    timings = [{"draft_n": 8, "draft_n_accepted": 6}, {"draft_n": 2, "draft_n_accepted": 0}]
    assert _acceptance({}, {}, timings) == {"acceptance": 0.6}
    assert _acceptance({}, {}, [{}]) == {}


def test_the_best_round_per_server_and_its_ratio_to_plain_pagellm():
    rounds = [[{"server": "pagellm", "workload": "w", "tok_s": 100.0},
               {"server": "pagellm-ngram", "workload": "w", "tok_s": 180.0},
               {"server": "llama-x", "workload": "v", "tok_s": 50.0}],
              [{"server": "pagellm", "workload": "w", "tok_s": 90.0},
               {"server": "pagellm-ngram", "workload": "w", "tok_s": 210.0}]]
    rows = {(r["server"], r["workload"]): r for r in _with_ratios(rounds)}
    assert rows[("pagellm", "w")]["tok_s"] == 100.0 and rows[("pagellm-ngram", "w")]["ratio"] == 2.1
    assert math.isnan(rows[("llama-x", "v")]["ratio"])  # no plain pagellm row for that workload
