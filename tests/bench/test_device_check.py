"""`pagellm bench device-check` rehearsed on the CPU at the tiny shape: what a GPU session will run, end to end."""

from __future__ import annotations

import json

from pagellm.cli import main
from tests.bench.cli_runner import run_cli


def test_the_cpu_rehearsal_checks_parity_and_measures_both_engines(tmp_path, capsys):
    out = tmp_path / "check.json"
    text = run_cli(capsys, "device-check", "--device", "cpu", "--shapes", "tiny", "--npl", "1,2", "--pp", "16",
                   "--tg", "4", "--peers", "hf", "--out", str(out))
    result = json.loads(out.read_text())
    parity = result["checks"]["parity"]
    assert parity["ok"] and parity["argmax_agreement"] == 1.0 and parity["max_abs_logit_difference"] < 1e-4
    assert "not_run" in result["checks"]["attention"]  # the Triton kernel is for CUDA (tests/gpu on a CPU)
    assert {(r["engine"], r["B"]) for r in result["rows"]} == {
        (engine, b) for engine in ("pagellm", "hf-transformers") for b in (1, 2)}
    assert all(r["S_PP"] > 0 and r["S_TG"] > 0 and r["shape"] == "tiny" for r in result["rows"])
    assert "S_TG t/s" in text


def test_an_unknown_shape_or_peer_is_named(capsys):
    assert main(["bench", "device-check", "--device", "cpu", "--shapes", "2b"]) == 2
    assert "--shapes: unknown shape(s) ['2b']; known: tiny, 1b, 8b" in capsys.readouterr().err


def test_the_attention_check_runs_the_kernel_under_the_interpreter_on_a_cpu():
    """What the GPU run checks in fp32 and bf16, rehearsed in fp32 (tests/conftest.py imported triton for it)."""
    from pagellm.bench import device_check
    from tests.gpu import interpreter

    with interpreter(True):
        result = device_check.attention("cpu")
    assert list(result) == ["float32"] and result["float32"]["ok"], result
    assert 0 < result["float32"]["worst_error_over_bound"] <= 1
