"""`pagellm bench mtp` at the tiny hybrid shape: the head made to predict the model has every draft accepted (the
in-place change reached the weights the kernels read), the random one none, and each run is beside plain's."""

from __future__ import annotations

import json

from tests.bench.cli_runner import run_cli


def test_the_predicting_head_is_accepted_and_the_random_one_missed(tmp_path, capsys):
    out = tmp_path / "mtp.json"
    text = run_cli(capsys, "mtp", "--shape", "tiny-hybrid", "--dtype", "float32", "--npl", "1", "--pp", "8", "--tg",
                   "8", "--k", "2",
                   "--rounds", "1", "--kv-cache-memory", "0.02", "--out", str(out))
    summary = {row["run"]: row for row in json.loads(out.read_text())["summary"]}
    assert set(summary) == {"plain", "mtp k=2", "mtp k=1, head misses, adaptive", "mtp k=1, head misses, fixed"}
    assert summary["plain"]["vs_plain"] == 1.0 and summary["plain"]["acceptance"] is None
    assert summary["mtp k=2"]["acceptance"] > 0.95 and summary["mtp k=2"]["tokens_per_verify"] > 2.5
    assert summary["mtp k=1, head misses, fixed"]["acceptance"] == 0.0
    assert "| mtp k=2 | 1 |" in text
