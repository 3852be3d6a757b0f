"""`pagellm bench compare` end to end on a tiny model: pagellm vs HF always, llama.cpp when installed."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagellm.bench.llama_cpp_peer import llama_cpp_available
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


def test_compare_a_shape_from_its_config_beside_both_hf_peers(tmp_path, capsys):
    """--load-format dummy --peers hf,hf-static: random weights from config.json alone, and HF's dynamic and
    static-cache generate on the same tensors, each with its ratio."""
    from tests.models.tiny_checkpoints import TINY_CONFIGS

    TINY_CONFIGS["llama"]().save_pretrained(tmp_path)
    out = tmp_path / "compare.json"
    run_cli(capsys, "compare", "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--npl", "1",
            "--pp", "8", "--tg", "2", "--repeats", "1", "--quick-roofline", "--peers", "hf,hf-static",
            "--out", str(out))
    report = json.loads(out.read_text())
    assert report["engines_run"] == ["pagellm", "hf-transformers", "hf-static"] and not report["peers_not_run"]
    for row in report["rows"]:
        assert row["pagellm/hf-static"] == pytest.approx(row["pagellm"] / row["hf-static"])


def test_llama_cpp_is_not_compared_with_an_engine_on_a_gpu(monkeypatch):
    """llama.cpp's peer runs on the CPU: beside pagellm on CUDA it is skipped, and the output says why."""
    from types import SimpleNamespace

    from pagellm.bench import compare

    monkeypatch.setattr(compare.report, "engine_dtypes", lambda engine: "bfloat16")
    engine = SimpleNamespace(device=torch.device("cuda"), quantization={},
                             config=SimpleNamespace(model=SimpleNamespace(quantization="none")))
    runners, _, skipped = compare.make_runners(SimpleNamespace(peers="llama.cpp", llama_threads=2), engine)
    assert list(runners) == ["pagellm"] and "runs on the CPU; pagellm runs on cuda" in skipped["llama.cpp"]


def test_hf_runs_on_a_quantized_ggufs_dequantized_weights(tmp_path, capsys):
    """pagellm keeps a GGUF's blocks as stored; HF runs on the same file dequantized, loaded as `bench accuracy`
    loads its dense reference, so its weights are exactly the file's values."""
    from gguf import GGMLQuantizationType as T

    from pagellm.bench import batched, compare
    from tests.loader.gguf_builders import write_tiny_gguf

    types = {"blk.0.attn_k.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q4_0, "blk.1.ffn_gate.weight": T.Q8_0}
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", types=types)
    engine = batched.build_engine(str(tiny.path), None, 2, 8, 2)
    try:
        assert engine.quantization  # the plan: pagellm quantized, HF dense
        runners, described, skipped = compare.make_runners(argparse.Namespace(peers="hf", llama_threads=1), engine)
        assert list(runners) == ["pagellm", "hf-transformers"] and not skipped
        assert "on the file's weights dequantized" in described["hf-transformers"]
        hf = runners["hf-transformers"].__self__.model
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
            assert torch.equal(hf.get_parameter(name), torch.from_numpy(tiny.expected[name])), name
        t_pp, t_tg = runners["hf-transformers"]([[1, 2, 3, 4]] * 2, 2)
        assert t_pp > 0 and t_tg > 0
    finally:
        engine.shutdown()


def test_hf_is_skipped_for_random_quantized_weights(monkeypatch):
    """--load-format dummy with quantized layers: no file to dequantize, so HF is not run, and the output says why."""
    from types import SimpleNamespace

    from pagellm.bench import compare

    engine = SimpleNamespace(device=torch.device("cpu"), quantization={"model.layers.0.mlp.down_proj": "int8"},
                             config=SimpleNamespace(model=SimpleNamespace(quantization="int8", load_format="dummy")))
    monkeypatch.setattr(compare.report, "engine_dtypes", lambda engine: "float32")
    runners, _, skipped = compare.make_runners(argparse.Namespace(peers="hf,hf-static"), engine)
    assert list(runners) == ["pagellm"]
    assert all("no file to dequantize" in skipped[p] for p in ("hf", "hf-static"))
