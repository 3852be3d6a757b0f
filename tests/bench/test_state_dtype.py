"""`pagellm bench state-dtype` at small sizes: both states timed at every level the host runs, and the drift rows
(the bf16 state's error small at first, bounded after, never zero: the rounding happened)."""

from __future__ import annotations

import json

from pagellm.kernels.build import native
from tests.bench.cli_runner import run_cli
from tests.kernels import requires_compiler

pytestmark = requires_compiler


def test_the_state_dtype_bench_times_every_level_and_measures_drift(tmp_path, capsys):
    out = tmp_path / "state.json"
    text = run_cli(capsys, "state-dtype", "--npl", "1,2", "--layers", "1", "--repeats", "1", "--rounds", "1",
                   "--tokens", "40", "--decays", "0.9,0.999", "--out", str(out))
    result = json.loads(out.read_text())
    assert {(r["level"], r["B"]) for r in result["speed"]} == {(lv, b) for lv in native.host_levels() for b in (1, 2)}
    assert all(r["float32_ms"] > 0 and r["bfloat16_ms"] > 0 for r in result["speed"])
    assert [r["decay"] for r in result["drift"]] == [0.9, 0.999]
    for row in result["drift"]:
        assert set(row["output_error"]) == {"40"}  # the checkpoints within --tokens: the last token alone
        assert 0 < row["output_error"]["40"] < 0.05 and 0 < row["state_error"] < 0.05
    assert "bf16 speed-up" in text and "output error @40" in text


def test_arguments_out_of_range_are_named(capsys):
    from pagellm.cli import main

    for argv, named in ((["--tokens", "0"], "--tokens must be >= 1"), (["--decays", "0.5,1"], "--decays must be"),
                        (["--repeats", "0"], "--repeats must be >= 1")):
        assert main(["bench", "state-dtype", *argv]) == 2
        assert named in capsys.readouterr().err
