"""`pagellm bench compare` end to end on a tiny model: pagellm vs HF always, llama.cpp when installed."""

from __future__ import annotations

import json

import pytest

from pagellm.bench.peers import llama_cpp_available
from tests.bench.cli_runner import run_cli


def test_compare_runs_pagellm_and_hf_and_says_which_peers_ran(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    text = run_cli(capsys, "compare", "--model", str(tiny_model_dir), "--npl", "1,2", "--pp", "16", "--tg", "3",
                   "--repeats", "2", "--quick-roofline", "--out", str(out))
    print(text)  # shows which peers ran in the pytest log (-s or on failure)
    assert "engines run: pagellm" in text and "hf-transformers" in text
    assert "roofline: peak GEMM" in text and "GB/s" in text
    report = json.loads(out.read_text())
    assert report["engines_run"][:2] == ["pagellm", "hf-transformers"]
    # An HF directory is not a GGUF: llama.cpp never runs on it, and the output says why.
    assert "llama.cpp" in report["peers_not_run"]
    assert "peer not run: llama.cpp" in text
    rows = report["rows"]
    assert [(r["B"], r["figure"]) for r in rows] == [(1, "S_PP"), (1, "S_TG"), (2, "S_PP"), (2, "S_TG")]
    for row in rows:
        assert row["pagellm"] > 0 and row["hf-transformers"] > 0
        assert row["pagellm/hf-transformers"] == pytest.approx(row["pagellm"] / row["hf-transformers"])
        assert row["roofline_pct"] > 0 and row["bound"] in ("bandwidth", "GEMM")
    assert all(len(v["S_TG"]) == 2 for v in report["measurements"].values())  # --repeats 2


@pytest.mark.skipif(llama_cpp_available() is not None, reason="llama-cpp-python not installed (bench extra)")
def test_compare_runs_llama_cpp_on_a_gguf(tmp_path, capsys):
    from tests.loader.gguf_builders import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    text = run_cli(capsys, "compare", "--model", str(path), "--npl", "1,2", "--pp", "8", "--tg", "3",
                   "--repeats", "1", "--quick-roofline", "--peers", "llama.cpp")
    print(text)
    assert "peer not run" not in text
    line = next(line for line in text.splitlines() if line.startswith("| 2 |") and "S_TG" in line)
    assert "unified" in line or "per-seq" in line
