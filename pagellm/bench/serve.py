"""`pagellm bench serve`: streaming clients against any OpenAI-compatible server, as `vllm bench serve`.

Requests go to /v1/completions, stream=true, `ignore_eos` so each produces --output-len tokens. Prompts come
from the model's tokenizer on the client side (--tokenizer, default the model's), so the server needs nothing
beyond /v1/completions and /v1/models (llama-server and vLLM work unchanged):

    --workload text     real text: a shared system prompt of --shared-prefix-len tokens cut from --text (the
                        GPL-3 Debian ships, else a built-in paragraph) and a unique question per request
    --workload random   --input-len random token ids (drawn from a fixed text's ids) after a shared prefix

They are sent at a Poisson --request-rate (default: all at once), at most --concurrency in flight; a
--disconnect-fraction of them (chosen by --seed) close their stream after three chunks. Per request:

    TTFT  send -> first streamed chunk        E2E  send -> end of stream
    ITL   gaps between successive chunks      TPOT (E2E - TTFT) / (output tokens - 1)

Output tokens are the server's `usage` where it sends one, else the client tokenizer's count of the text.
Against a pagellm server the prefix-cache hit ratio and preemptions are the change of its /metrics counters
over the run (other servers: not reported).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from pagellm.bench import report
from pagellm.bench.report import Column

SEED_TEXT = ("The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches; "
             "meanwhile, a curious engineer measures latency, throughput and memory on two small cores. ") * 8
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
TOPICS = ("copying", "distribution", "source code", "patents", "warranty", "liability", "modification", "licensees",
          "conveying", "termination", "installation information", "additional terms", "acceptance", "the program")


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    dropped: bool = False  # the client closed the stream early (--disconnect-fraction), as a user who leaves


def _httpx():
    try:
        import httpx
    except ImportError as exc:
        raise ValueError(f"bench serve needs httpx: {sys.executable} -m pip install httpx") from exc
    return httpx


def build_prompts(token_pool: list[int], n: int, input_len: int, shared_prefix_len: int, seed: int) -> list[list[int]]:
    """n prompts of shared_prefix_len + input_len random ids; the prefix is one and the same for all."""
    rng = random.Random(seed)
    prefix = [rng.choice(token_pool) for _ in range(shared_prefix_len)]
    return [prefix + [rng.choice(token_pool) for _ in range(input_len)] for _ in range(n)]


def text_prompts(tokenizer, text: str, n: int, shared_prefix_len: int, seed: int) -> list[str]:
    """n prompts of real text: the first shared_prefix_len tokens of `text` (one system prompt for all), then a
    question of its own per request."""
    prefix = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:shared_prefix_len])
    rng = random.Random(seed)
    return [f"{prefix}\n\nQuestion {i + 1}: in two sentences, what does the text above say about "
            f"{rng.choice(TOPICS)}, and why does it matter to {rng.choice(TOPICS)}?\nAnswer:" for i in range(n)]


def client_tokenizer(path: str | None):
    """The tokenizer prompts are built and counted with: a GGUF file or HF directory (None: the embedded model)."""
    from pagellm.config import ModelConfig
    from pagellm.loader.default_model import default_model_path
    from pagellm.loader.tokenizer import load_tokenizer

    return load_tokenizer(path or default_model_path(), ModelConfig().cache_dir or None)


def workload_prompts(args, tokenizer) -> list[str | list[int]]:
    if args.workload == "random":
        # ids a real text uses; a vocabulary that cannot spell it (a test's) gives its whole range
        pool = sorted(set(tokenizer.encode(SEED_TEXT, add_special_tokens=False)))
        pool = pool or [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids]
        return build_prompts(pool, args.num_prompts, args.input_len, args.shared_prefix_len, args.seed)
    path = Path(args.text) if args.text else DEFAULT_TEXT
    text = path.read_text() if args.text or path.is_file() else SEED_TEXT
    return text_prompts(tokenizer, text, args.num_prompts, args.shared_prefix_len, args.seed)


# A disconnecting client (--disconnect-fraction) closes its stream after this many chunks.
DISCONNECT_AFTER_CHUNKS = 3


def request_fields(args) -> dict:
    """What every request asks besides its prompt: --output-len tokens, greedy unless --temperature; a sampled
    request turns top-k and min-p off, so that every server samples the same distribution (llama-server would
    apply its own defaults of 40 and 0.05)."""
    temperature, top_p = getattr(args, "temperature", 0.0), getattr(args, "top_p", 1.0)
    fields = {"max_tokens": args.output_len, "temperature": temperature}
    if temperature > 0:
        fields |= {"top_p": top_p, "top_k": 0, "min_p": 0.0}
    return fields


async def _one_request(client, url: str, model: str, prompt: str | list[int], fields: dict, headers,
                       tokenizer, disconnect: bool = False) -> RequestResult:
    body = {"model": model, "prompt": prompt, **fields, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    prompt_len = len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))
    result = RequestResult(ok=False, prompt_len=prompt_len)
    pieces = []
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    pieces.append(chunk["choices"][0].get("text") or "")
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - t0
                    else:
                        result.itls.append(now - last)
                    last = now
                    if disconnect and len(pieces) >= DISCONNECT_AFTER_CHUNKS:
                        result.dropped = True
                        break  # leaving the block closes the connection: the server sees the client go
    except Exception as exc:  # a transport error fails this request, not the run
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - t0
    result.ok = result.ttft > 0
    if not result.output_tokens or result.dropped:  # no usage from this server: count the text with the client's tokenizer
        result.output_tokens = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
    return result


async def _run_clients(url, model, prompts, fields: dict, rate: float, concurrency: int | None, headers, seed,
                       tokenizer, disconnect_fraction: float = 0.0, chunk_timeout: float | None = None):
    httpx = _httpx()
    rng = random.Random(seed + 1)
    leaving = set(random.Random(seed + 2).sample(range(len(prompts)), round(disconnect_fraction * len(prompts))))
    limit = asyncio.Semaphore(concurrency or len(prompts))
    timeout = httpx.Timeout(None, connect=30.0, read=chunk_timeout)  # a stalled stream fails, the run goes on
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        async def limited(prompt, disconnect):
            async with limit:
                return await _one_request(client, url, model, prompt, fields, headers, tokenizer, disconnect)

        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt, i in leaving)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        return await asyncio.gather(*tasks)


def scrape_metrics(url: str, headers) -> dict[str, float]:
    """The un-labelled pagellm: samples of /metrics ('_total' dropped from counters); {} from other servers."""
    response = _httpx().get(url + "/metrics", headers=headers, timeout=30)
    text = response.text if response.status_code == 200 else ""
    values = {}
    for line in text.splitlines():
        if line.startswith("pagellm:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.removeprefix("pagellm:").removesuffix("_total")] = float(value)
    return values


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p):
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]

    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict) -> dict:
    """Throughput counts every streamed token; TTFT and ITL every answered request; TPOT and E2E the requests
    that ran to their end (not those whose client left)."""
    answered = [r for r in results if r.ok]
    done = [r for r in answered if not r.dropped]
    out_tokens = sum(r.output_tokens for r in answered)
    queried = after.get("prefix_cache_queried_tokens", 0) - before.get("prefix_cache_queried_tokens", 0)
    hits = after.get("prefix_cache_hit_tokens", 0) - before.get("prefix_cache_hit_tokens", 0)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    known = "num_preemptions" in after  # a pagellm server: its counters

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    steps = delta("num_steps")
    host_ms = (after.get("host_ms_per_step", 0) * after.get("num_steps", 0)
               - before.get("host_ms_per_step", 0) * before.get("num_steps", 0))  # the run's, from the means
    decode_steps = delta("step_reuse_hits") + delta("step_reuse_misses")
    summary = {
        "completed": len(done), "dropped": len(answered) - len(done), "failed": len(results) - len(answered),
        "duration_s": duration,
        "request_throughput": len(done) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in answered)) / duration,
        "prefix_cache_hit_ratio": (hits / queried if queried else 0.0) if known else None,
        "preemptions": after["num_preemptions"] - before.get("num_preemptions", 0) if known else None,
        "host_ms_per_step": host_ms / steps if known and steps else None,
        "step_reuse_rate": delta("step_reuse_hits") / decode_steps if known and decode_steps else None,
        "decode_graph_replay_rate": delta("decode_graph_replays") / decode_steps if known and decode_steps else None,
    }
    for name, values in (("ttft_ms", [r.ttft for r in answered]), ("tpot_ms", tpots),
                         ("itl_ms", [x for r in answered for x in r.itls]), ("e2e_ms", [r.e2e for r in done])):
        for stat, value in _percentiles(values).items():
            summary[f"{stat}_{name}"] = value * 1e3
    return summary


LATENCY_COLUMNS = (Column("metric", "metric"), Column("mean", "mean ms", "{:.1f}"),
                   Column("median", "median ms", "{:.1f}"), Column("p90", "p90 ms", "{:.1f}"),
                   Column("p99", "p99 ms", "{:.1f}"))


def latency_rows(summary: dict) -> list[dict]:
    return [{"metric": m.upper(), **{s: summary[f"{s}_{m}_ms"] for s in ("mean", "median", "p90", "p99")}}
            for m in ("ttft", "tpot", "itl", "e2e")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server process the bench starts (`cmd` listens on `port`), healthy once /health answers 200."""

    name: str
    cmd: list[str]
    port: int
    proc: subprocess.Popen | None = None
    log: IO[bytes] | None = None  # its stderr

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> None:
        httpx = _httpx()
        # stderr to a file, not a pipe: nobody reads a pipe while the server runs, and a server that logs every
        # request (llama-server does) blocks on its write once the pipe's 64 KiB are full, and stops serving
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s")

    def log_tail(self, size: int = 2000) -> str:
        """The last `size` characters the server wrote to stderr."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-size:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pagellm_server(serve_args: list[str]) -> Server:
    """`pagellm serve` on a free port."""
    port = free_port()
    return Server("pagellm", [sys.executable, "-m", "pagellm.cli", "serve", "--port", str(port), *serve_args], port)


def run(url: str, args, headers: dict, tokenizer, prompts, request_rate: float | None = None
        ) -> tuple[dict, list[RequestResult], str]:
    """One run of `prompts` against the server at `url` (at args.request_rate unless given)."""
    model = _httpx().get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    before = scrape_metrics(url, headers)
    t0 = time.perf_counter()
    rate = args.request_rate if request_rate is None else request_rate
    results = asyncio.run(_run_clients(url, model, prompts, request_fields(args), rate, args.concurrency, headers,
                                       args.seed, tokenizer, args.disconnect_fraction, args.chunk_timeout))
    duration = time.perf_counter() - t0
    after = scrape_metrics(url, headers)
    return summarize(results, duration, before, after), results, model


def print_and_save(summary: dict, results: list[RequestResult], args, settings: dict) -> None:
    print(f"completed {summary['completed']}, dropped by their client {summary['dropped']}, failed "
          f"{summary['failed']} in {summary['duration_s']:.2f} s")
    print(f"request throughput {summary['request_throughput']:.3f} req/s, output token throughput "
          f"{summary['output_token_throughput']:.2f} tok/s, total token throughput "
          f"{summary['total_token_throughput']:.2f} tok/s")
    if summary["preemptions"] is not None:
        print(f"server: prefix cache hit ratio {summary['prefix_cache_hit_ratio']:.3f}, "
              f"preemptions {summary['preemptions']:.0f}, host ms per step {summary['host_ms_per_step'] or 0:.2f}, "
              f"step reuse rate {summary['step_reuse_rate'] or 0:.2f}")
    print(report.format_table(latency_rows(summary), LATENCY_COLUMNS))
    errors = sorted({r.error for r in results if r.error})
    for error in errors[:5]:
        print(f"error: {error}")
    if args.out:
        report.write_json(args.out, {"settings": settings, "summary": summary,
                                     "requests": [asdict(r) for r in results]})
    if args.plot:
        _plot(args.plot, results, settings)
        print(f"wrote {args.plot}")


def _plot(path: str, results: list[RequestResult], settings: dict) -> None:
    from pagellm.bench.report import finish_plot, pyplot

    plt = pyplot()
    done = [r for r in results if r.ok]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, values in (("TTFT", [r.ttft for r in done]), ("E2E", [r.e2e for r in done])):
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    title = (f"pagellm bench serve: {settings['num_prompts']} requests, in {settings['input_len']}"
             f" (+{settings['shared_prefix_len']} shared), out {settings['output_len']}")
    finish_plot(plt, fig, ax, path, "seconds", "fraction of requests", title)


def check_workload(args) -> None:
    """ValueError naming the flag for a workload that cannot run."""
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {args.request_rate}")
    if args.chunk_timeout <= 0:
        raise ValueError(f"--chunk-timeout must be > 0 seconds, got {args.chunk_timeout}")
    if not 0 <= args.disconnect_fraction <= 1:
        raise ValueError(f"--disconnect-fraction must be in [0, 1], got {args.disconnect_fraction}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} and "
                         f"{args.top_p}")


def main(args) -> int:
    if args.out is not None and Path(args.out).suffix != ".json":
        raise ValueError(f"--out {args.out}: bench serve writes JSON, the file name must end in .json")
    check_workload(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    settings = {k: getattr(args, k) for k in ("workload", "num_prompts", "input_len", "output_len", "temperature",
                                              "top_p", "shared_prefix_len", "request_rate", "concurrency", "seed")}
    tokenizer = client_tokenizer(args.tokenizer or args.model)
    prompts = workload_prompts(args, tokenizer)
    server = None
    url = args.base_url.rstrip("/")
    if args.start_server:
        serve_args = ["--model", args.model] if args.model else []
        serve_args += args.serve_args.split() if args.serve_args else []
        server = pagellm_server(serve_args)
        url = server.url
    try:
        if server is not None:
            server.start()
        summary, results, model = run(url, args, headers, tokenizer, prompts)
    finally:
        if server is not None:
            server.stop()
    settings.update(url=url, model=model, request_rate=str(args.request_rate))
    print(f"server {url}, model {model}; " + ", ".join(
        f"{k} {v}" for k, v in settings.items() if k not in ("url", "model")))
    print_and_save(summary, results, args, settings)
    return 0
