"""`pagellm bench serve` end to end: a real `pagellm serve` of a tiny GGUF, streaming clients, /metrics."""

from __future__ import annotations

import json
import re

import pytest

from tests.bench.cli_runner import run_cli

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_serve_bench_reports_latencies_throughput_and_prefix_hits(tmp_path, capsys):
    from tests.loader.gguf_builders import write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, "llama")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    text = run_cli(capsys, "serve", "--start-server", "--model", str(model),
                   "--serve-args", "--kv-cache-memory 0.01 --max-model-len 128",
                   "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--shared-prefix-len", "48",
                   "--concurrency", "3", "--temperature", "0.8", "--top-p", "0.9", "--out", str(out),
                   "--plot", str(png))
    assert "completed 6, dropped by their client 0, failed 0" in text
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        assert re.search(rf"\|\s*{metric} \|", text), metric
    assert "prefix cache hit ratio" in text and "preemptions" in text
    written = json.loads(out.read_text())
    summary = written["summary"]
    assert written["settings"]["temperature"] == 0.8 and written["settings"]["top_p"] == 0.9
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_token_throughput"] > 0 and summary["request_throughput"] > 0
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "median", "p90", "p99"):
            assert summary[f"{stat}_{metric}_ms"] >= 0
    assert 0 < summary["median_ttft_ms"] <= summary["median_e2e_ms"]
    # 48 shared tokens = 3 full blocks: every request after the first ones finds them cached.
    assert summary["prefix_cache_hit_ratio"] > 0
    assert summary["preemptions"] == 0
    assert summary["host_ms_per_step"] > 0 and 0 <= summary["step_reuse_rate"] <= 1  # the run's, from /metrics
    assert png.read_bytes()[:4] == b"\x89PNG"


LOUD_SERVER = """
import http.server, sys
sys.stderr.write("x" * 300_000)  # past a pipe's 64 KiB: a server logging every request gets there
sys.stderr.flush()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_that_logs_much_is_not_blocked_on_its_stderr():
    import sys

    from pagellm.bench.serve import Server, free_port

    port = free_port()
    server = Server("loud", [sys.executable, "-c", LOUD_SERVER, str(port)], port)
    try:
        server.start(timeout=60)  # with stderr a pipe nobody reads, its write blocks and /health never answers
        assert "x" * 1000 in server.log_tail(400_000)  # all of it kept, in the file
    finally:
        server.stop()


def test_sampled_requests_turn_off_what_a_server_would_add():
    """Greedy by default; --temperature samples, top-k and min-p off on every server (llama-server's own defaults
    would narrow its distribution); a bad value is a ValueError naming the flag."""
    from types import SimpleNamespace

    from pagellm.bench import serve

    assert serve.request_fields(SimpleNamespace(output_len=8)) == {"max_tokens": 8, "temperature": 0.0}
    sampled = SimpleNamespace(output_len=8, temperature=0.7, top_p=0.95)
    assert serve.request_fields(sampled) == {"max_tokens": 8, "temperature": 0.7, "top_p": 0.95, "top_k": 0,
                                             "min_p": 0.0}
    args = SimpleNamespace(request_rate=1.0, chunk_timeout=1.0, disconnect_fraction=0.0, temperature=0.7, top_p=0.0)
    with pytest.raises(ValueError, match="--top-p"):
        serve.check_workload(args)
