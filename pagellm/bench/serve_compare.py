"""`pagellm bench serve-compare`: pagellm's server and llama-server on the same model file, the same clients.

Each server is started in turn on a free port with matched capacity (pagellm `--max-num-seqs N`; llama-server
`-np N -c N*ctx --cont-batching`, its prompt cache on as by default), warmed with one request, and given the
same seeded workload (bench/serve.py: real text with a shared system prompt, streaming). Per server: completed
/ failed, output tok/s, TTFT / ITL / E2E p50 and p99, its process's resident set (VmRSS) at /health, after the
warm-up request and a second after each load, and its peak (VmHWM). Each load runs --rounds times in a row, each
round with prompts of its own (the workload drawn with --seed + round - 1): a server whose memory grows with use
shows it round by round. Workloads:

    poisson   --num-prompts at a Poisson --request-rate
    burst     --num-prompts at once
    sweep     the Poisson workload at each of --rates (ascending) until p99 TTFT passes --ttft-bound or a
              request fails; the highest rate held is reported
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pagellm.bench import serve
from pagellm.bench import report
from pagellm.bench.peer_setup import install_hint, llama_tool, tools_dir
from pagellm.bench.report import Column, format_table

COLUMNS = (Column("server", "server"), Column("load", "load"), Column("completed", "done"),
           Column("failed", "failed"), Column("output_token_throughput", "out tok/s", "{:.1f}"),
           Column("median_ttft_ms", "TTFT p50 ms", "{:.0f}"), Column("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
           Column("median_itl_ms", "ITL p50 ms", "{:.0f}"), Column("p99_itl_ms", "ITL p99 ms", "{:.0f}"),
           Column("median_e2e_ms", "E2E p50 ms", "{:.0f}"), Column("rss_mb", "RSS after MB", "{:.0f}"),
           Column("peak_rss_mb", "peak RSS MB", "{:.0f}"), Column("prefix_cache_hit_ratio", "prefix hits", "{:.2f}"),
           Column("host_ms_per_step", "host ms/step", "{:.2f}"), Column("step_reuse_rate", "step reuse", "{:.2f}"))


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), MB."""
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    """The process's resident set now (VmRSS), MB."""
    return _status_mb(pid, "VmRSS")


# Resident memory is read this long after a round's last response: a server may still be freeing its requests.
SETTLE_S = 1.0


SERVERS = ("pagellm", "llama-server")


def servers(args, model: str) -> list[serve.Server]:
    """pagellm and llama-server (those of --servers) with the same model file and the same number of sequences at
    once."""
    chosen = [name.strip() for name in args.servers.split(",")]
    if not chosen or any(name not in SERVERS for name in chosen):
        raise ValueError(f"--servers takes {', '.join(SERVERS)}, comma-separated, got {args.servers!r}")
    if not model.endswith(".gguf"):
        raise ValueError(f"serve-compare serves one GGUF file with both servers, got --model {model!r}")
    made = {"pagellm": lambda: serve.pagellm_server(
        ["--model", model, "--max-num-seqs", str(args.slots), "--max-model-len", str(args.ctx),
         *args.serve_args.split()]), "llama-server": lambda: _llama_server(args, model)}
    return [made[name]() for name in chosen]


def _llama_server(args, model: str) -> serve.Server:
    if args.llama_server is not None and not Path(args.llama_server).is_file():
        raise ValueError(f"--llama-server {args.llama_server}: no such file")
    llama = args.llama_server or llama_tool("llama-server")
    if llama is None:
        raise ValueError(f"llama-server is neither on PATH nor in {tools_dir()}: "
                         f"{install_hint('it')}, or give --llama-server PATH")
    peer = serve.Server("llama-server", [], serve.free_port())
    peer.cmd = [llama, "-m", model, "--host", "127.0.0.1", "--port", str(peer.port), "-np", str(args.slots),
                "-c", str(args.slots * args.ctx), "--cont-batching", "-t", str(args.threads),
                "-tb", str(args.threads), *args.llama_args.split()]
    return peer


def _measure(server: serve.Server, args, tokenizer, prompts, rate: float, load: str) -> tuple[dict, list]:
    summary, results, _ = serve.run(server.url, args, {}, tokenizer, prompts, request_rate=rate)
    return {"server": server.name, "load": load, **summary}, results


def _loads(args) -> list[tuple[str, float]]:
    if args.load == "burst":
        return [("burst", float("inf"))]
    if args.load == "sweep":
        return [(f"{rate:g}/s", rate) for rate in sorted(args.rates)]
    return [(f"{args.request_rate:g}/s", args.request_rate)]


def run_one_server(server: serve.Server, args, tokenizer, rounds: list[list]) -> tuple[list[dict], dict]:
    """Every load (--rounds times each) against one server (a sweep stops past the TTFT bound); rows and each
    row's requests. Each row has the server's VmRSS after its round, and its RSS at /health and after the
    warm-up request."""
    rows, requests = [], {}
    server.start()
    try:
        at_health = rss_mb(server.proc.pid)
        serve.run(server.url, args, {}, tokenizer, rounds[0][:1], request_rate=float("inf"))  # warm-up
        time.sleep(SETTLE_S)
        after_first = rss_mb(server.proc.pid)
        for load, rate in _loads(args):
            for round_, prompts in enumerate(rounds, 1):
                name = load if args.rounds == 1 else f"{load} #{round_}"
                row, results = _measure(server, args, tokenizer, prompts, rate, name)
                time.sleep(SETTLE_S)
                rows.append({**row, "rss_mb": rss_mb(server.proc.pid)})
                requests[name] = results
            if args.load == "sweep" and (row["failed"] or row["p99_ttft_ms"] > args.ttft_bound * 1e3):
                break
        peak = peak_rss_mb(server.proc.pid)
    finally:
        server.stop()
    for row in rows:
        row.update(peak_rss_mb=peak, rss_at_health_mb=at_health, rss_after_first_mb=after_first)
    return rows, requests


def _rss_line(row: dict) -> str:
    return (f"{row['server']}: RSS {row['rss_at_health_mb']:.0f} MB at /health, {row['rss_after_first_mb']:.0f} MB "
            "after the warm-up request")


def held_rate(rows: list[dict], bound_s: float) -> float:
    """The highest swept rate with every request done and p99 TTFT under the bound (0: none)."""
    held = [float(r["load"].removesuffix("/s")) for r in rows if not r["failed"] and r["p99_ttft_ms"] <= bound_s * 1e3]
    return max(held, default=0.0)


def torch_build() -> str:
    """Which torch the pagellm server ran on: a CUDA build loads its CUDA libraries even on a machine without a
    GPU (~285 MB of the server's RSS on Linux x86-64, measured: docs/benchmarks/2026-11-25-serving-memory.md)."""
    import torch

    if torch.version.cuda is None:
        return f"pagellm's torch: {torch.__version__} (CPU-only build)"
    return (f"pagellm's torch: {torch.__version__}, a CUDA {torch.version.cuda} build: its CUDA libraries are "
            f"in pagellm's peak RSS")


def main(args) -> int:
    from pagellm.loader.default_model import default_model_path

    serve.check_workload(args)
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    model = str(args.model or default_model_path())
    tokenizer = serve.client_tokenizer(args.tokenizer or model)
    # each round its own prompts (the workload drawn with the next seed): what stays resident after a round is
    # then the server's to keep, not a cache the next round hits
    rounds = [serve.workload_prompts(argparse.Namespace(**{**vars(args), "seed": args.seed + r}), tokenizer)
              for r in range(args.rounds)]
    rows, requests = [], {}
    for server in servers(args, model):
        server_rows, server_requests = run_one_server(server, args, tokenizer, rounds)
        rows += server_rows
        requests[server.name] = server_requests
        print(format_table(server_rows, COLUMNS), file=sys.stderr, flush=True)  # progress of a long run
        print(_rss_line(server_rows[0]), file=sys.stderr, flush=True)
    print(f"model {model}; {args.slots} sequences at once, {args.ctx} tokens each; workload {args.workload}, "
          f"{args.num_prompts} requests, shared prefix {args.shared_prefix_len} tokens, {args.output_len} out, "
          + (f"temperature {args.temperature:g}, top-p {args.top_p:g}" if args.temperature > 0 else "greedy"))
    print(torch_build())
    print(format_table(rows, COLUMNS))
    for name in requests:
        print(_rss_line(next(r for r in rows if r["server"] == name)))
    if args.load == "sweep":
        for name in requests:
            rate = held_rate([r for r in rows if r["server"] == name], args.ttft_bound)
            print(f"{name}: highest rate held with p99 TTFT <= {args.ttft_bound:g} s: {rate:g} req/s")
    if args.out:
        report.write_json(args.out, {"rows": rows, "sampling": serve.request_fields(args), "requests": {
            name: {load: [r.__dict__ for r in results] for load, results in by_load.items()}
            for name, by_load in requests.items()}})
    if args.plot:
        _plot(args.plot, requests)
        print(f"wrote {args.plot}")
    return 0


def _plot(path: str, requests: dict) -> None:
    from pagellm.bench.report import finish_plot, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, by_load in requests.items():
        load, results = list(by_load.items())[-1]
        for metric, values in (("TTFT", [r.ttft for r in results if r.ok]),
                               ("ITL", [x for r in results if r.ok for x in r.itls])):
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=f"{name} {metric} ({load})")
    ax.set_xscale("log")
    finish_plot(plt, fig, ax, path, "seconds", "fraction", "pagellm serve vs llama-server: latency CDFs")
