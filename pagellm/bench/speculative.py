"""`pagellm bench speculative`: speculative decoding's speed on the same GGUF, pagellm beside llama-server.

Servers, each started in turn on a free port, in rounds (every server once per round: alternated):

    pagellm             `pagellm serve`, no speculation
    pagellm-<method>    `pagellm serve --speculative-config` (--spec-config: n-gram lookup by default, adaptive length)
    llama-server        no speculation
    llama-<type>        llama-server --spec-type <type> for each of --llama-spec-types (its n-gram kinds)

Workloads at B=1 (one request at a time, greedy, ignore_eos, --output-len tokens, streamed): a code edit (a
function given and asked back with one name changed), a summary of a given text, and free prose. A request's
decode speed is (tokens - 1) / (last chunk - first chunk), the prefill left out; a workload's is its requests'
tokens over their decode time. Then B=32 (--batch requests of prose at once): output tokens over the wall time.
pagellm's acceptance (accepted / proposed drafts, tokens per verify step) comes from its /metrics; llama-server's
from the timings of its last chunk where it reports them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import textwrap
import time
from pathlib import Path

from pagellm.bench import report, serve
from pagellm.bench.report import Column, format_table

COLUMNS = (Column("server", "server"), Column("workload", "workload"), Column("tok_s", "tok/s", "{:.1f}"),
           Column("ratio", "vs pagellm", "{:.2f}"), Column("acceptance", "accepted", "{:.2f}"),
           Column("tokens_per_verify", "tok/verify", "{:.2f}"))

GPL3 = "/usr/share/common-licenses/GPL-3"


GREEDY = {"temperature": 0.0}
# free prose sampled, as people write it: greedy, a small model soon repeats itself, which lookups would exploit
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "seed": 1}


def workloads(text_path: str = GPL3) -> dict[str, tuple[str, dict]]:
    """The B=1 prompts and their sampling, from texts that do not change with this repository: the standard
    library's textwrap.dedent (the same for a Python version) and the GPL-3's preamble (Debian's
    /usr/share/common-licenses, or `text_path`)."""
    function = inspect.getsource(textwrap.dedent)
    text = Path(text_path).read_text()
    preamble = text[text.index("Preamble"):][:2400]
    return {
        "code-edit": (f"# Original:\n{function}\n\n# The same function, with `margin` renamed to `indent`:\n",
                      GREEDY),
        "summary": (f"{preamble}\n\nSummary of the text above, sentence by sentence:\n", GREEDY),
        "prose": ("Once upon a time, in a small village by the sea, there lived an old fisherman who", SAMPLED),
    }


def _servers(args, model: str) -> list[serve.Server]:
    common = ["--model", model, "--max-num-seqs", str(max(args.batch, 4)), "--max-model-len", str(args.ctx)]
    made = [serve.pagellm_server(common), serve.pagellm_server([*common, "--speculative-config", args.spec_config])]
    made[1].name = f"pagellm-{json.loads(args.spec_config).get('method', 'ngram')}"
    if args.llama_server:
        for spec in ["none", *args.llama_spec_types.split(",")]:
            peer = serve.Server("llama-server" if spec == "none" else f"llama-{spec}", [], serve.free_port())
            peer.cmd = [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(peer.port),
                        "-np", str(args.batch), "-c", str(args.batch * args.ctx), "--cont-batching",
                        "-t", str(args.threads), "-tb", str(args.threads)]
            if spec != "none":
                peer.cmd += ["--spec-type", spec, *args.llama_spec_args.split()]
            made.append(peer)
    return made


async def _one(client, url: str, model: str, prompt: str, sampling: dict, max_tokens: int
               ) -> tuple[int, float, dict]:
    """(tokens, decode seconds: first chunk to last, the last chunk's timings if any) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            **sampling}
    first = last = None
    timings: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            timings = chunk.get("timings") or timings
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                last = time.perf_counter()
                first = first or last
    return max_tokens, (last - first) if first and last else float("nan"), timings


async def _run(url: str, prompts: list[str], sampling: dict, max_tokens: int, concurrent: bool
               ) -> tuple[list, float]:
    httpx = serve._httpx()
    # a fresh connection per request: llama-server, in the build measured, dropped reused ones now and then
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        model = (await client.get(url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        t0 = time.perf_counter()
        if concurrent:
            results = await asyncio.gather(*(_one(client, url, model, p, sampling, max_tokens) for p in prompts))
        else:
            results = [await _one(client, url, model, p, sampling, max_tokens) for p in prompts]
        return results, time.perf_counter() - t0


def _acceptance(before: dict, after: dict, timings: list[dict]) -> dict:
    """Accepted / proposed drafts and tokens per verify step: pagellm's counters, or llama-server's timings."""
    drafts = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
    if drafts:
        verifies = after["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0)
        accepted = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
        return {"acceptance": accepted / drafts, "tokens_per_verify": 1 + accepted / max(verifies, 1)}
    drafted = sum(t.get("draft_n", 0) for t in timings)
    if drafted:
        return {"acceptance": sum(t.get("draft_n_accepted", 0) for t in timings) / drafted}
    return {}


def _workload_row(server: serve.Server, args, name: str, prompt: str, sampling: dict) -> dict:
    """One B=1 workload: a warm-up request (its prefix cached as for the measured ones), then --repeats."""
    _run_sync(server.url, [prompt], sampling, 8, False)
    before = serve.scrape_metrics(server.url, {})
    results, _ = _run_sync(server.url, [prompt] * args.repeats, sampling, args.output_len, False)
    after = serve.scrape_metrics(server.url, {})
    tokens, seconds = sum(n - 1 for n, _, _ in results), sum(s for _, s, _ in results)
    return {"server": server.name, "workload": name, "batch": 1, "tok_s": tokens / seconds,
            **_acceptance(before, after, [t for _, _, t in results])}


def _batch_row(server: serve.Server, args, prose: str, sampling: dict) -> dict:
    """--batch prose requests at once: output tokens over the wall time."""
    before = serve.scrape_metrics(server.url, {})
    prompts = [prose + [i] if isinstance(prose, list) else f"{prose} (story {i})" for i in range(args.batch)]
    results, wall = _run_sync(server.url, prompts, sampling, args.output_len, True)
    after = serve.scrape_metrics(server.url, {})
    return {"server": server.name, "workload": f"prose B={args.batch}", "batch": args.batch,
            "tok_s": sum(n for n, _, _ in results) / wall, **_acceptance(before, after, [])}


def measure(server: serve.Server, args, prompts: dict[str, tuple[str, dict]]) -> list[dict]:
    """One server's rows: each B=1 workload, then B=--batch prose. A server that drops a connection (llama-server
    did, now and then, in the build measured) is restarted and the workload run again, once."""
    runs = [lambda n=name, p=prompt, s=sampling: _workload_row(server, args, n, p, s)
            for name, (prompt, sampling) in prompts.items()]
    runs.append(lambda: _batch_row(server, args, *prompts["prose"]))
    rows = []
    for run in runs:
        try:
            rows.append(run())
        except serve._httpx().HTTPError as exc:
            print(f"{server.name} failed ({exc!r}), restarted:\n{server.log_tail()}", flush=True)
            server.stop()
            server.start()
            rows.append(run())
    return rows


def _run_sync(url, prompts, sampling, max_tokens, concurrent):
    return asyncio.run(_run(url, prompts, sampling, max_tokens, concurrent))


def _with_ratios(rounds: list[list[dict]]) -> list[dict]:
    """Each (server, workload)'s best round, with its ratio to plain pagellm's best on that workload."""
    best: dict[tuple[str, str], dict] = {}
    for row in (row for rows in rounds for row in rows):
        key = (row["server"], row["workload"])
        if key not in best or row["tok_s"] > best[key]["tok_s"]:
            best[key] = row
    for (server, workload), row in best.items():
        plain = best.get(("pagellm", workload))
        row["ratio"] = row["tok_s"] / plain["tok_s"] if plain else float("nan")
    return list(best.values())


def main(args) -> int:
    from pagellm.loader.default_model import default_model_path

    model = str(args.model or default_model_path())
    prompts = workloads(args.text)
    if args.prompt_ids:  # a file whose vocabulary is a placeholder (bench/hybrid_gguf.py's): token ids, seeded
        rng = random.Random(0)
        prompts = {name: ([rng.randrange(1, 250) for _ in range(args.prompt_ids)], sampling)
                   for name, (_, sampling) in prompts.items()}
    rounds: list[list[dict]] = []
    for round_ in range(args.rounds):
        rows = []
        for server in _servers(args, model):
            server.start()
            try:
                rows += measure(server, args, prompts)
                print(f"round {round_ + 1}: {server.name} done", flush=True)
            except serve._httpx().HTTPError as exc:  # a peer that fails is reported, the others still run
                print(f"round {round_ + 1}: {server.name} failed: {exc!r}\n{server.log_tail()}", flush=True)
            finally:
                server.stop()
        rounds.append(rows)
    best = _with_ratios(rounds)
    print(format_table(best, COLUMNS))
    machine = report.machine_info("float32", "pagellm serve defaults")
    print(report.describe_machine(machine))
    if args.out:
        report.write_json(args.out, {"machine": machine, "model": model, "spec_config": args.spec_config,
                                     "output_len": args.output_len, "repeats": args.repeats, "rows": best,
                                     "rounds": rounds})
    return 0
