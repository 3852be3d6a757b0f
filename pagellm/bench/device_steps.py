"""The device check's step modes: decode CUDA graphs and async scheduling, against the eager engine.

    ids        the tiny parity model (fp32), requests arriving and finishing at different steps: each mode's greedy
               ids against eager's, its graph replays and steps launched ahead, and on CUDA the syncs torch's
               sync debug mode flags per decode step (the target is none inside a step)
    speed      llama-batched-bench rows of each mode at the real shapes, one engine at a time (a mode is a start
               option: graphs are captured at load), named pagellm-<mode> beside the eager rows; on CUDA with the
               device's idle time per decode step (the wall time of steady steps minus its kernels' time)
    serving    `pagellm bench serve`'s client against `pagellm serve` on the device, eager and each mode

Graphs exist only on CUDA: on a CPU the rehearsal runs async scheduling alone.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from pagellm.bench import batched

# Every mode says both settings: unset, they follow the device (graphs and async on CUDA)
MODES = {"eager": {"enforce_eager": True, "async_scheduling": False},
         "graphs": {"enforce_eager": False, "async_scheduling": False},
         "async": {"enforce_eager": True, "async_scheduling": True},
         "graphs-async": {"enforce_eager": False, "async_scheduling": True}}
SERVE_FLAGS = {"eager": ["--enforce-eager", "--no-async-scheduling"],
               "graphs": ["--no-enforce-eager", "--no-async-scheduling"],
               "async": ["--enforce-eager", "--async-scheduling"],
               "graphs-async": ["--no-enforce-eager", "--async-scheduling"]}


def modes_for(device: str) -> list[str]:
    """The modes beside eager: graphs exist only on CUDA."""
    return [m for m in MODES if m != "eager"] if torch.device(device).type == "cuda" else ["async"]


def same_ids(device: str, weights: Path) -> dict:
    """Each mode's greedy ids against eager's on the same weights, and what the mode did."""
    from pagellm.llm import LLM
    from pagellm.sampling_params import SamplingParams

    script = {0: [[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3: [[14] * 20, [5, 6, 7, 1]]}
    lengths = iter((9, 4, 12, 6, 7))
    params = {tuple(p): SamplingParams(max_tokens=next(lengths), temperature=0.0, ignore_eos=True)
              for step in script.values() for p in step}
    results = {}
    for mode in ["eager", *modes_for(device)]:
        try:
            with LLM(str(weights), skip_tokenizer_init=True, device=device, dtype="float32", kv_cache_memory=0.05,
                     max_num_seqs=8, **MODES[mode]) as llm:
                engine, prompts, finished, step = llm.engine, {}, {}, 0
                with _flagged_syncs(device) as flagged:
                    while step <= max(script) or engine.has_unfinished_requests():
                        for prompt in script.get(step, ()):
                            prompts[engine.add_request(prompt, params[tuple(prompt)])] = tuple(prompt)
                        for out in engine.step():
                            if out.finished:
                                finished[prompts[out.request_id]] = out.outputs[0].token_ids
                        step += 1
                stats = llm.stats()
        except Exception as e:  # noqa: BLE001 - a mode that fails is a failed check, the others still run
            results[mode] = {"ids": None, "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            continue
        decode_steps = stats["step_reuse_hits"] + stats["step_reuse_misses"]
        results[mode] = {"ids": finished, "graph_replays": stats["decode_graph_replays"],
                         "steps_launched_ahead": stats["steps_launched_ahead"], "decode_steps": decode_steps,
                         "flagged_syncs_per_step": flagged.count / max(stats["num_steps"], 1)
                         if flagged.count is not None else None}
    eager = results.pop("eager")
    if eager["ids"] is None:
        raise RuntimeError(f"the eager reference run failed: {eager['error']}")
    equal = {mode: r["ids"] is not None and r["ids"] == eager["ids"] for mode, r in results.items()}
    checks = {mode: {**{k: v for k, v in r.items() if k != "ids"}, "ids_equal": equal[mode], "ok": equal[mode]}
              for mode, r in results.items()}
    checks["eager"] = {"flagged_syncs_per_step": eager["flagged_syncs_per_step"], "ok": True}
    return checks


class _flagged_syncs:
    """On CUDA, the host syncs torch's sync debug mode warns about while the block runs (count); else None."""

    def __init__(self, device: str):
        self.cuda, self.count = torch.device(device).type == "cuda", None

    def __enter__(self):
        if self.cuda:
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._caught.__exit__(*exc)
            self.count = sum("synchroniz" in str(w.message) for w in self._records)


def state_dtype_of(engine) -> str | None:
    """A hybrid model's recurrent state's dtype ("float32"), None for a model without one: a row's "state"."""
    layers = getattr(engine.model, "state_layers", list)()
    return str(layers[0].state_dtype).removeprefix("torch.") if layers else None


def speed_rows(args: argparse.Namespace, shape: str, config_dir: Path, kv_gib: float, errors: dict[str, str],
               measured=lambda rows: None) -> list[dict]:
    """llama-batched-bench rows of each step mode of --modes at `shape`, engine after engine (medians of
    --repeats), each mode's given to `measured` as it ends (a run cut short keeps them); a mode that fails is said
    in `errors`."""
    rows = []
    for mode in [m for m in modes_for(args.device) if m in args.modes]:
        try:
            rows += _mode_rows(args, shape, config_dir, kv_gib, mode)
        except Exception as e:  # noqa: BLE001 - one mode's failure (a capture, say) must not lose the others
            errors[f"{shape} pagellm-{mode}"] = f"{type(e).__name__}: {e}"
            print(f"  {shape} pagellm-{mode}: not measured: {type(e).__name__}: {e}", file=sys.stderr)
        measured(rows)
    return rows


def _mode_rows(args: argparse.Namespace, shape: str, config_dir: Path, kv_gib: float, mode: str) -> list[dict]:
    rows = []
    engine = batched.build_engine(str(config_dir), args.dtype, max(args.npl), args.pp, args.tg,
                                  kv_cache_memory=kv_gib, device=args.device, load_format="dummy",
                                  mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, **MODES[mode])
    try:
        rng, vocab = random.Random(args.seed), engine.hf_config.vocab_size
        for b in args.npl:  # warm-up at every measured shape
            batched.timed_run(engine, batched.random_prompts(rng, b, args.pp, vocab, False), args.tg)
        for b in args.npl:
            figures, before = [], dict(engine.stats())
            for _ in range(args.repeats):
                prompts = batched.random_prompts(rng, b, args.pp, vocab, False)
                figures.append(batched.batched_row(args.pp, args.tg, b, *batched.timed_run(engine, prompts,
                                                                                           args.tg)))
            after = engine.stats()
            decode_steps = sum(after[k] - before[k] for k in ("step_reuse_hits", "step_reuse_misses"))
            row = {"shape": shape, "B": b, "engine": f"pagellm-{mode}", "PP": args.pp, "TG": args.tg,
                   "state": state_dtype_of(engine),
                   **{k: statistics.median(r[k] for r in figures) for k in ("S_PP", "S_TG")},
                   "graph_replay_rate": (after["decode_graph_replays"] - before["decode_graph_replays"])
                   / max(decode_steps, 1),
                   "gpu_idle_ms_per_step": gpu_idle_ms_per_step(
                       engine, batched.random_prompts(rng, b, args.pp, vocab, False), args.tg)}
            print(f"  {shape} B={b} pagellm-{mode}: S_PP {row['S_PP']:.1f} S_TG {row['S_TG']:.1f}",
                  file=sys.stderr)
            rows.append(row)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def gpu_idle_ms_per_step(engine, prompts: list[list[int]], tg: int, window: int = 16) -> float | None:
    """On CUDA: the device's idle time per decode step (wall time of `window` steady decode steps minus the time
    its kernels ran, over the steps), from torch's profiler; None elsewhere."""
    if engine.device.type != "cuda" or engine.has_unfinished_requests():
        return None
    from pagellm.sampling_params import SamplingParams

    window = min(window, tg // 2)
    params = SamplingParams(max_tokens=tg, temperature=0.0, ignore_eos=True)  # what the engine was sized for
    for prompt in prompts:
        engine.add_request(prompt, params)
    for _ in range(tg - window - 1):  # past prefill and into steady decode, `window` steps left at least
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(window):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    busy_us = sum(event.self_device_time_total for event in profile.key_averages())
    while engine.has_unfinished_requests():
        engine.step()
    return max(wall_us - busy_us, 0.0) / window / 1e3


def serving_model(directory: Path) -> Path:
    """The --load-format dummy model whose config.json is in `directory`, given a byte-level BPE tokenizer trained
    on the workload's text and its vocabulary cut to it: a device machine has no room for a real file, and its
    ids must all decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from pagellm.bench import serve

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([serve.SEED_TEXT] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    config = AutoConfig.from_pretrained(directory)
    config.vocab_size, config.bos_token_id, config.eos_token_id = tokenizer.get_vocab_size(), 0, 1
    config.save_pretrained(directory)
    return directory


def serving(args: argparse.Namespace, model: Path) -> dict:
    """A short `bench serve` run (streaming clients, Poisson arrivals) against `pagellm serve` on the device with
    `model` (random weights), eager and each mode: throughput, TTFT and what the server counted; repeated
    --serve-rounds times, the memory in use read after each (the device's on CUDA, the server's resident set on a
    CPU), then a prompt longer than the model takes, whose answer must be a 4xx, not a crash."""
    from pagellm.bench import serve

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the results
    tokenizer = serve.client_tokenizer(str(model))
    options = SimpleNamespace(workload="text", text=None, num_prompts=args.serve_prompts,
                              shared_prefix_len=args.serve_shared_prefix,
                              seed=args.seed, request_rate=args.serve_rate, output_len=args.tg, concurrency=None,
                              disconnect_fraction=0.0, chunk_timeout=300.0)  # a stalled stream fails alone
    prompts = serve.workload_prompts(options, tokenizer)
    results = {}
    for mode in [m for m in ["eager", *modes_for(args.device)] if m in args.modes]:
        server = serve.pagellm_server(["--model", str(model), "--load-format", "dummy", "--device", args.device,
                                       "--max-num-seqs", str(args.serve_max_seqs), "--kv-cache-memory", "4",
                                       *SERVE_FLAGS[mode]])
        try:
            server.start()
            memory, failed = [], 0
            for _ in range(args.serve_rounds):  # a soak: the same workload again, memory read after each
                summary, runs, _ = serve.run(server.url, options, {}, tokenizer, prompts)
                memory.append(_memory_mib(args.device, server.proc.pid))
                failed += summary.get("failed") or 0
            too_long = _too_long_status(server.url, tokenizer.vocab_size)
        except Exception as e:  # noqa: BLE001 - one mode's failure must not lose the others
            results[mode] = {"error": f"{type(e).__name__}: {e}"}
            continue
        finally:
            server.stop()
        results[mode] = {k: summary.get(k) for k in ("completed", "output_token_throughput",
                                                     "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                     "prefix_cache_hit_ratio", "host_ms_per_step",
                                                     "decode_graph_replay_rate")}
        results[mode] |= {"failed": failed, "memory_mib_after_each_round": memory, "too_long_status": too_long}
        print(f"  serving {mode}: {results[mode]}", file=sys.stderr)
    return results


def _memory_mib(device: str, pid: int) -> float:
    """Memory in use: the GPU's (every process on it) on CUDA, else the server process's resident set."""
    if torch.device(device).type == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return (total - free) / 2**20
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def _too_long_status(url: str, vocab_size: int) -> int:
    """The HTTP status of a completion whose prompt (token ids) is longer than any context the server holds."""
    import httpx

    prompt = [i % vocab_size for i in range(300_000)]
    response = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120)
    return response.status_code
