"""`pagellm bench serve-compare` end to end: both servers started in turn, the same clients, the table, the sweep.

llama-server is stood in for by a shim that takes its flags and serves with pagellm (the real one needs a
15-minute build, ../shared/peers/build-llama-cpp.sh): what is tested is the orchestration, the workloads and
the report, not the peer.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.bench.cli_runner import run_cli

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

SHIM = '''#!{python}
import argparse, os, sys
parser = argparse.ArgumentParser()
for flag in ("-m", "--host", "--port", "-np", "-c", "-t", "-tb"):
    parser.add_argument(flag)
parser.add_argument("--cont-batching", action="store_true")
args = parser.parse_args()
os.execv(sys.executable, [sys.executable, "-m", "pagellm.cli", "serve", "--model", args.m, "--port", args.port,
                          "--max-num-seqs", args.np, "--max-model-len", str(int(args.c) // int(args.np)),
                          "--kv-cache-memory", "0.01"])
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.loader.gguf_builders import write_tiny_gguf

    directory = tmp_path_factory.mktemp("compare")
    model = directory / "tiny.gguf"
    write_tiny_gguf(model, "llama")
    shim = directory / "llama-server"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    return model, shim


def test_both_servers_get_the_same_workload_and_a_row_each(tiny, tmp_path, capsys):
    model, shim = tiny
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    text = run_cli(capsys, "serve-compare", "--llama-server", str(shim), "--model", str(model), "--slots", "3",
                   "--ctx", "128", "--serve-args", "--kv-cache-memory 0.01", "--num-prompts", "5",
                   "--shared-prefix-len", "24", "--output-len", "4", "--request-rate", "20",
                   "--out", str(out), "--plot", str(png))
    rows = json.loads(out.read_text())["rows"]
    assert [r["server"] for r in rows] == ["pagellm", "llama-server"]
    for row in rows:
        assert row["completed"] == 5 and row["failed"] == 0 and row["output_token_throughput"] > 0
        assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"] and row["peak_rss_mb"] > 100
    assert re.search(r"\|\s+pagellm \|\s+20/s \|\s+5 \|\s+0 \|", text)
    import torch  # the report names the torch build, whose CUDA libraries (if any) are in pagellm's RSS
    assert f"pagellm's torch: {torch.__version__}" in text
    assert ("CUDA" in text) == (torch.version.cuda is not None)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_rounds_read_resident_memory_after_each_and_clients_may_leave_early(tiny, tmp_path, capsys):
    model, shim = tiny
    out = tmp_path / "rounds.json"
    text = run_cli(capsys, "serve-compare", "--llama-server", str(shim), "--model", str(model), "--slots", "3",
                   "--ctx", "128", "--num-prompts", "5", "--shared-prefix-len", "16", "--output-len", "8",
                   "--load", "burst", "--rounds", "2", "--disconnect-fraction", "0.4", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["server"], r["load"]) for r in rows] == [
        ("pagellm", "burst #1"), ("pagellm", "burst #2"), ("llama-server", "burst #1"), ("llama-server", "burst #2")]
    for row in rows:
        assert row["completed"] == 3 and row["dropped"] == 2 and row["failed"] == 0
        assert 100 < row["rss_at_health_mb"] and 100 < row["rss_mb"] <= row["peak_rss_mb"]
    assert "pagellm: RSS" in text and "after the warm-up request" in text


def test_bad_workload_flags_are_named(tiny, capsys):
    from pagellm.cli import main

    model, shim = tiny
    for flags, name in ((["--rounds", "0"], "--rounds must be"), (["--disconnect-fraction", "1.5"],
                        "--disconnect-fraction must be"), (["--servers", "vllm"], "--servers takes")):
        assert main(["bench", "serve-compare", "--llama-server", str(shim), "--model", str(model), *flags]) != 0
        assert f"error: {name}" in capsys.readouterr().err


def test_servers_picks_which_run(tiny, capsys):
    model, _ = tiny
    text = run_cli(capsys, "serve-compare", "--servers", "pagellm", "--model", str(model), "--slots", "2",
                   "--ctx", "128", "--num-prompts", "2", "--shared-prefix-len", "16", "--output-len", "2",
                   "--load", "burst")
    assert re.search(r"\|\s+pagellm \|\s+burst \|", text) and "llama-server" not in text


def test_a_sweep_stops_past_the_ttft_bound_and_names_the_rate_held(tiny, tmp_path, capsys):
    model, shim = tiny
    text = run_cli(capsys, "serve-compare", "--llama-server", str(shim), "--model", str(model), "--slots", "2",
                   "--ctx", "128", "--num-prompts", "3", "--shared-prefix-len", "16", "--output-len", "2",
                   "--load", "sweep", "--rates", "50,5", "--ttft-bound", "0.000001")
    # a bound no request meets: the first (lowest) rate already passes it, and the sweep stops there
    assert len(re.findall(r"\|\s+5/s \|", text)) == 2 and "50/s" not in text
    assert "pagellm: highest rate held with p99 TTFT <= 1e-06 s: 0 req/s" in text


def test_text_prompts_share_a_prefix_of_the_text_and_differ_after_it():
    from pagellm.bench.serve import client_tokenizer, text_prompts

    tokenizer = client_tokenizer(None)
    text = Path("/usr/share/common-licenses/GPL-3").read_text() if Path("/usr/share/common-licenses/GPL-3").is_file() \
        else "All work and no play makes Jack a dull boy. " * 100
    prompts = text_prompts(tokenizer, text, 4, 100, seed=1)
    prefix = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:100])
    assert all(p.startswith(prefix + "\n\nQuestion ") for p in prompts) and len(set(prompts)) == 4
    assert text_prompts(tokenizer, text, 4, 100, seed=1) == prompts  # seeded
