"""`pagellm bench compare`: the same workloads on pagellm and its peers, in one run, alternating.

For each batch size B in --npl (B = 1 is the single-stream workload) every
engine runs B random prompts of PP tokens and TG decode steps, greedy; the
engines take turns (pagellm, HF, llama.cpp, pagellm, ...) --repeats times, and
the median of each figure is printed with the ratio pagellm / peer. The
figures are llama-batched-bench's S_PP (prefill tokens/s) and S_TG (decode
tokens/s). Each pagellm figure is also placed under the machine's roofline.

On a GPU (`--device cuda`, with `--load-format dummy` any shape from its config.json): the roofline is the
device's, the peers are HF's two generates on the same tensors (`--peers hf,hf-static`; llama.cpp runs on the
CPU and is skipped), and pagellm's KV budget defaults to a quarter of the free device memory.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from pagellm.bench import batched, peers, report, roofline
from pagellm.bench.llama_cpp_peer import LlamaCppPeer, llama_cpp_available
from pagellm.bench.peer_process import PeerProcess
from pagellm.bench.report import Column
from pagellm.platform import GIB

PAGELLM = "pagellm"


def make_runners(args: argparse.Namespace, engine, stack: contextlib.ExitStack | None = None
                 ) -> tuple[dict, dict[str, str], dict[str, str]]:
    """name -> run(prompts, tg); name -> description of what ran; peer -> why it did not run. A peer process
    started here is closed with `stack` (else when this process ends)."""
    runners = {PAGELLM: functools.partial(batched.timed_run, engine)}
    # what was asked (auto on an HF checkpoint is none), unless no layer ended up quantized
    quantized = engine.config.model.quantization if engine.quantization else "none"
    described = {PAGELLM: f"LLMEngine, {report.engine_dtypes(engine)}, weights {quantized}, "
                          f"{torch.get_num_threads()} torch threads"}
    skipped: dict[str, str] = {}
    wanted = {p.strip() for p in args.peers.split(",") if p.strip()}
    unknown = wanted - {"hf", "hf-static", "llama.cpp"}
    if unknown:
        raise ValueError(f"--peers: unknown peer(s) {sorted(unknown)}; known: hf, hf-static, llama.cpp")
    model = None  # one HF model on the same weights serves both HF peers
    for peer in ("hf", "hf-static"):
        if peer in wanted and peers.why_no_dense_weights(engine) is not None:
            skipped[peer] = peers.why_no_dense_weights(engine)
        elif peer in wanted:
            hf = peers.HFTransformersPeer(engine, static=peer == "hf-static", model=model)
            runners[hf.name], described[hf.name], model = hf.run, hf.description, hf.model
    if "llama.cpp" in wanted and engine.device.type != "cpu":
        skipped["llama.cpp"] = f"the llama.cpp peer runs on the CPU; pagellm runs on {engine.device}"
    elif "llama.cpp" in wanted:
        reason = llama_cpp_available()
        if reason is None and engine.model_path.suffix != ".gguf":
            reason = f"{engine.model_path} is not a GGUF file"
        if reason is not None:
            skipped["llama.cpp"] = reason
        else:
            lc = PeerProcess(LlamaCppPeer, engine.model_path, args.llama_threads)  # its own heap: peer_process.py
            if stack is not None:
                stack.callback(lc.close)
            for unified in (True, False):
                name = f"llama.cpp[{'unified' if unified else 'per-seq'} KV]"
                runners[name] = lambda prompts, tg, u=unified: lc.run(prompts, tg, u)
            described["llama.cpp"] = (lc.description + ", in a process of its own; unified and per-sequence KV "
                                      "both run, the better reported")
    return runners, described, skipped


def measure_all(runners: dict, engine, npl: list[int], pp: int, tg: int, repeats: int, seed: int) -> dict:
    """{(name, B): {"S_PP": [...], "S_TG": [...]}}, engines alternating within every repeat."""
    rng = random.Random(seed)
    vocab = engine.hf_config.vocab_size
    for run in runners.values():  # warm-up: start-up costs stay out of the figures
        run(batched.random_prompts(rng, 1, min(pp, 16), vocab, False), 2)
    figures: dict = {}
    for r in range(repeats):
        for b in npl:
            prompts = batched.random_prompts(rng, b, pp, vocab, False)
            for name, run in runners.items():
                t_pp, t_tg = run(prompts, tg)
                row = batched.batched_row(pp, tg, b, t_pp, t_tg)
                slot = figures.setdefault((name, b), {"S_PP": [], "S_TG": []})
                slot["S_PP"].append(row["S_PP"])
                slot["S_TG"].append(row["S_TG"])
                print(f"  repeat {r + 1}/{repeats} B={b} {name}: S_PP {row['S_PP']:.1f} S_TG {row['S_TG']:.1f}",
                      file=sys.stderr)
    return figures


def summarize(figures: dict, engine, roof: roofline.Roofline, npl, pp: int, tg: int) -> list[dict]:
    """One row per (B, figure): medians, ratios pagellm / peer, and pagellm against the roofline."""
    weights = roofline.WeightCounts.of(engine.model)
    int8 = roofline.runs_int8_activations(engine.model)
    names = list(dict.fromkeys(name for name, _ in figures))
    rows = []
    for b in npl:
        for figure in ("S_PP", "S_TG"):
            med = {n: statistics.median(figures[(n, b)][figure]) for n in names}
            ours = med[PAGELLM]
            row = {"B": b, "PP": pp, "TG": tg, "figure": figure, PAGELLM: ours}
            lc = {n: v for n, v in med.items() if n.startswith("llama.cpp[")}
            peer_meds = {n: v for n, v in med.items() if n != PAGELLM and n not in lc}
            if lc:
                best = max(lc, key=lc.get)
                peer_meds["llama.cpp"] = lc[best]
                row["llama.cpp_kv"] = best[len("llama.cpp["):-len(" KV]")]
            for n, v in peer_meds.items():
                row[n] = v
                row[f"{PAGELLM}/{n}"] = ours / v
            if figure == "S_PP":
                seconds, flops = b * pp / ours, weights.prefill_flops(b * pp, b)
            else:
                seconds, flops = b / ours, weights.decode_flops(b)  # one decode step of B tokens
            row["roofline_pct"], row["bound"] = roofline.percent_of_roofline(
                roof, flops, weights.bytes_read_per_step, seconds, int8)
            rows.append(row)
    return rows


def table_columns(rows: list[dict]) -> list[Column]:
    cols = [Column("B", "B"), Column("figure", "figure"), Column(PAGELLM, "pagellm t/s", "{:.1f}")]
    for peer in ("hf-transformers", "hf-static", "llama.cpp"):
        if rows and peer in rows[0]:
            cols += [Column(peer, f"{peer} t/s", "{:.1f}"), Column(f"{PAGELLM}/{peer}", "ratio", "{:.2f}")]
            if peer == "llama.cpp":
                cols.append(Column("llama.cpp_kv", "llama.cpp KV"))
    cols += [Column("roofline_pct", "pagellm % roofline", "{:.1f}"), Column("bound", "bound")]
    return cols


def main(args: argparse.Namespace) -> int:
    if args.out is not None and Path(args.out).suffix != ".json":
        raise ValueError(f"--out {args.out}: compare writes JSON, the file name must end in .json")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    kv_cache_memory = args.kv_cache_memory
    if kv_cache_memory is None and torch.device(args.device).type == "cuda":  # not gpu_memory_utilization's 0.9:
        kv_cache_memory = torch.cuda.mem_get_info(args.device)[0] / 4 / GIB  # the HF peers need the rest
    engine = batched.build_engine(args.model, args.dtype, max(args.npl), args.pp, args.tg,
                                  block_size=args.block_size, kv_cache_memory=kv_cache_memory,
                                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                                  mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                                  cpu_isa=args.cpu_isa, device=args.device, load_format=args.load_format,
                                  enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    machine = report.machine_info(report.dtype_name(engine.dtype), engine.kernels)
    print(report.describe_machine(machine))
    if engine.device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(engine.device)}, torch {torch.__version__}")
    print(f"model: {engine.model_path}")
    roof = roofline.measure_roofline(engine.dtype, quick=args.quick_roofline, device=args.device)
    print(roof.describe())
    with contextlib.ExitStack() as stack:
        runners, described, skipped = make_runners(args, engine, stack)
        print("engines run: " + "; ".join(f"{n} ({d})" for n, d in described.items()))
        for name, reason in skipped.items():
            print(f"peer not run: {name}: {reason}")
        print(f"workloads: B in {args.npl}, PP {args.pp}, TG {args.tg}, greedy; {args.repeats} repeats, "
              f"engines alternating, medians shown\n")
        figures = measure_all(runners, engine, args.npl, args.pp, args.tg, args.repeats, args.seed)
    rows = summarize(figures, engine, roof, args.npl, args.pp, args.tg)
    print(report.format_table(rows, table_columns(rows)))
    print("\nratio = pagellm / peer (above 1: pagellm faster). roofline: weights only; bound = "
          "max(weight bytes / bandwidth, 2 * params * tokens / peak GEMM) per step, attention excluded; int8 GEMM: "
          "int4 layers with int8 activations, bound by the int8 matmul peak")
    if args.out:
        raw = {f"{name}|B={b}": v for (name, b), v in figures.items()}
        report.write_json(args.out, {
            "machine": machine, "model": str(engine.model_path), "roofline": asdict(roof),
            "engines_run": list(described), "engine_descriptions": described, "peers_not_run": skipped,
            "settings": {"npl": args.npl, "pp": args.pp, "tg": args.tg, "repeats": args.repeats},
            "rows": rows, "measurements": raw})
    return 0
