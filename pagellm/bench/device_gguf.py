"""`pagellm bench device-gguf`: the prepared GPU run for GGUF weights kept in their blocks (planes), rehearsed on
a CPU at tiny shapes.

    1. numerics: the Triton matmuls on real tensors (a sample of a real GGUF's Q4_K, Q5_0 and Q6_K tensors,
       --sample, carried to the device) at every kernel's M, against the exact product of the dequantized weights
       in fp64: the worst error over bf16's rounding bound (on a CPU: fp32 under TRITON_INTERPRET=1), plus the
       activations' rounding for the int8 gemv, and each kernel's relative error (the accuracy beside its speed);
    2. crossovers: each kernel timed per M at an 8B MLP matrix, per format: the fastest, and where it changes,
       and where the int8 gemv beats the bf16 one (CUDA only);
    3. speed: a Q4_K_M Llama (or Qwen3.5-MoE: bench/hybrid_gguf.py) of the shape written on the machine itself,
       then llama-batched-bench rows (PP, TG, npl) for the file in planes, the same file dequantized to bf16
       (--quantization none), graphs on, engines alternating; and llama.cpp's own `llama-batched-bench` on the
       same file where a binary is given. Each engine's resident weights beside the file's size.

    pagellm bench device-gguf --device cuda --shape 8b --npl 1,16,64 --pp 512 --tg 64 --sample sample.gguf \
        --out gguf.json
    pagellm bench device-gguf --device cpu --shape tiny --npl 1,2 --pp 16 --tg 4 --sample sample.gguf   (rehearsal)
    pagellm bench device-gguf --write-sample sample.gguf      (on the host: from the embedded model's file)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from pagellm.bench import batched, device_check, device_steps, gguf_files, report
from pagellm.bench.hybrid_gguf import write_hybrid_gguf
from pagellm.bench.hybrid_shapes import HYBRID_SHAPES
from pagellm.bench.report import Column

T = gguf_files.T
SHAPES = {"tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256),
          "1b": device_check.SHAPES["1b"], "8b": device_check.SHAPES["8b"]}
SAMPLE_TYPES = (T.Q4_K, T.Q5_0, T.Q6_K)  # what the embedded model's file holds of the kernel formats
ENGINES = {"pagellm-gguf": "auto", "pagellm-dequantized": "none"}  # engine -> --quantization
COLUMNS = [Column("shape", "shape"), Column("B", "B"), Column("engine", "engine"), Column("weights", "weights"),
           Column("S_PP", "S_PP t/s", "{:.1f}"), Column("S_TG", "S_TG t/s", "{:.1f}"),
           Column("weight_gib", "weights GiB", "{:.2f}")]


def numerics(device: str, sample: Path | None) -> dict:
    """Per sampled tensor and kernel: the worst error over its bound (<= 1 passes)."""
    on_cuda = torch.device(device).type == "cuda"
    if sample is None:
        return {"not_run": "no --sample (pagellm bench device-gguf --write-sample FILE on the host)"}
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"not_run": "the Triton kernels need CUDA, or TRITON_INTERPRET=1 for their interpreter on a CPU"}
    import gguf

    from pagellm.kernels.gpu import gguf_matmul
    from pagellm.kernels.reference import gguf_planes
    from pagellm.loader.gguf_planes import planes_of

    dtype = torch.bfloat16 if on_cuda else torch.float32  # the interpreter has no bf16
    results, generator = {}, torch.Generator().manual_seed(0)
    for tensor in gguf.GGUFReader(str(sample)).tensors:
        kind, rows = T(tensor.tensor_type), int(tensor.shape[1])
        planes = planes_of(tensor.data, kind, (rows, int(tensor.shape[0]))).to(device)
        weight = gguf_planes.dequantize(planes).double()
        crossovers = gguf_matmul.CROSSOVERS[kind]
        for name, m in (("gemv", 1), ("gemv", crossovers.gemv_max), ("gemv-q8", 1), ("gemv-q8", crossovers.gemv_max),
                        ("dot", crossovers.gemv_max + 8), ("dense", crossovers.dot_max + 8)):
            x = torch.randn(m, planes.cols, generator=generator).to(device, dtype)
            int8 = name == "gemv-q8"
            got = gguf_matmul.BoundPlanesMatmul([planes], None, int8_activations=int8)(x).double()
            exact = x.double() @ weight.T
            # bf16: the output's rounding, and the dot/dense kernels' weights rounded to bf16: 2^-8 of |x| |w|
            bound = (2.0**-8 if dtype == torch.bfloat16 else 1e-6) * (x.double().abs() @ weight.abs().T) + 1e-30
            if int8:  # each activation within half its group's step (kernels/gpu/gguf_gemv_q8.py)
                step = gguf_planes.quantize_rows(x)[1].double().repeat_interleave(32, dim=1) / 2
                bound = bound + step @ weight.abs().T
            worst = ((got - exact).abs() / bound).max().item()
            results[f"{tensor.name} {kind.name} {name} M={m}"] = {
                "worst_error_over_bound": worst, "ok": worst <= 1,
                "relative_error": ((got - exact).norm() / exact.norm()).item()}  # the accuracy beside the speed
    return results


def crossovers(device: str, shape: dict) -> dict:
    """Each kernel's time per M at the shape's gate/up matrix [I, E], per format, and the fastest per M."""
    if torch.device(device).type != "cuda":
        return {"not_run": "timing the kernels needs CUDA"}
    from pagellm.kernels.gpu import gguf_gemv_q8, gguf_matmul
    from pagellm.loader.gguf_planes import planes_of

    rng, result = np.random.default_rng(0), {}
    rows, cols = shape["intermediate_size"], shape["hidden_size"]
    for kind in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0):
        planes = planes_of(gguf_files.random_blocks(rng, kind, rows, cols), kind, (rows, cols)).to(device)
        bound, times = gguf_matmul.BoundPlanesMatmul([planes], None), {}
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            x = torch.randn(m, cols, device=device, dtype=torch.bfloat16)
            out = torch.empty(m, rows, device=device, dtype=torch.bfloat16)
            kernels = {"dense": lambda: bound._dense(x, out)}
            if m <= 8:  # the int8 gemv's time includes quantizing the activations
                kernels["gemv"] = lambda: bound._gemv(x, planes, None, out)
                kernels["gemv-q8"] = lambda: bound._gemv(x, planes, None, out, gguf_gemv_q8.quantize_rows(x))
            if m >= 16:
                kernels["dot"] = lambda: bound._dot(x, planes, None, out)
            times[m] = {name: _cuda_ms(run) for name, run in kernels.items()}
        # the crossovers of the kernels a default run takes (the int8 gemv is off until it is measured faster)
        fastest = {m: min((k for k in t if k != "gemv-q8"), key=t.get) for m, t in times.items()}
        result[kind.name] = {"ms": times, "fastest": fastest,
                             "gemv_max": max([m for m, k in fastest.items() if k == "gemv"], default=0),
                             "int8_gemv_faster_at": [m for m, t in times.items() if "gemv" in t
                                                     and t["gemv-q8"] < t["gemv"]],
                             "dot_max": max([m for m, k in fastest.items() if k == "dot"], default=0)}
    return result


def _cuda_ms(run, repeats: int = 20) -> float:
    run()  # compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def speed(args: argparse.Namespace, path: Path) -> list[dict]:
    """Rows of the file in planes and dequantized, engines alternating (medians of --repeats)."""
    mode = device_steps.MODES["graphs-async" if torch.device(args.device).type == "cuda" else "async"]
    kv = device_check.kv_gib(args.shape, args) if args.shape in HYBRID_SHAPES else \
        device_check.kv_gib_for(SHAPES[args.shape], args)
    engines = {name: batched.build_engine(str(path), args.dtype, max(args.npl), args.pp, args.tg, device=args.device,
                                          kv_cache_memory=kv, quantization=q,
                                          mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, **mode)
               for name, q in ENGINES.items() if name in args.engines}
    if not engines:
        return []
    try:
        runners = {name: functools.partial(batched.timed_run, engine) for name, engine in engines.items()}
        vocab = next(iter(engines.values())).hf_config.vocab_size
        figures = device_check.alternated(args, args.shape, runners, vocab, random.Random(args.seed))
        held = {name: engine.memory["weight_bytes"] / 2**30 for name, engine in engines.items()}
        state = device_steps.state_dtype_of(next(iter(engines.values())))
        weights = {name: "q4_k_m" if ENGINES[name] == "auto" else f"q4_k_m as {report.engine_dtypes(engine)}"
                   for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
    return [{"engine": name, "shape": args.shape, "weights": weights[name], "B": b, "PP": args.pp, "TG": args.tg,
             "weight_gib": held[name], "state": state, **figure} for (name, b), figure in figures.items()]


def llama_cpp_rows(binary: str, path: Path, args: argparse.Namespace) -> list[dict]:
    """llama.cpp's own llama-batched-bench on the same file, every layer on the GPU, flash attention on."""
    command = [binary, "-m", str(path), "-c", str(max(args.npl) * (args.pp + args.tg) + 256), "-b", "2048",
               "-ub", "512", "-npp", str(args.pp), "-ntg", str(args.tg), "-npl", ",".join(map(str, args.npl)),
               "-ngl", "99", "-fa", "on", "--output-format", "jsonl"]
    output = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True).stdout
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [{"engine": "llama.cpp", "shape": args.shape, "weights": "q4_k_m", "B": r["pl"], "PP": r["pp"],
             "TG": r["tg"], "S_PP": r["speed_pp"], "S_TG": r["speed_tg"], "weight_gib": None} for r in rows]


def main(args: argparse.Namespace) -> int:
    if args.write_sample:
        source = Path(args.write_sample_from) if args.write_sample_from else _embedded_file()
        names = gguf_files.write_sample(source, Path(args.write_sample), SAMPLE_TYPES)
        print(f"wrote {len(names)} tensors of {source.name} to {args.write_sample}: {', '.join(names)}")
        return 0
    if args.shape not in SHAPES and args.shape not in HYBRID_SHAPES:
        raise ValueError(f"--shape: unknown shape {args.shape!r}; known: {', '.join([*SHAPES, *HYBRID_SHAPES])}")
    if set(args.engines) - {*ENGINES, "llama.cpp"}:
        raise ValueError(f"--engines: unknown engine(s) {sorted(set(args.engines) - {*ENGINES, 'llama.cpp'})}; "
                         f"known: {', '.join([*ENGINES, 'llama.cpp'])}")
    on_cuda = torch.device(args.device).type == "cuda"
    gpu = torch.cuda.get_device_name(args.device) if on_cuda else "CPU"
    result = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "commit": args.commit or _commit(),
              "rows": [], "errors": {}, "checks": {} if args.skip_checks else checks(args)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.file) if args.file else Path(tmp) / f"llama-{args.shape}-q4_k_m.gguf"
        if not path.exists() and args.shape in HYBRID_SHAPES:  # a Qwen3.5-MoE: its experts in blocks too
            write_hybrid_gguf(args.shape, path)
        elif not path.exists():
            gguf_files.write_llama_gguf(SHAPES[args.shape], path)
        result["file_gib"] = path.stat().st_size / 2**30
        for name, measure in (("pagellm", lambda: speed(args, path)),
                              ("llama.cpp", lambda: llama_cpp_rows(args.llama_batched_bench, path, args)
                               if args.llama_batched_bench and "llama.cpp" in args.engines else [])):
            try:
                result["rows"] += [row | {"gpu": gpu, "commit": result["commit"]} for row in measure()]
            except Exception as e:  # noqa: BLE001 - one engine's failure must not lose the other's rows
                result["errors"][name] = f"{type(e).__name__}: {e}"
                print(f"{name}: not measured: {result['errors'][name]}", file=sys.stderr)
            if args.out:  # after each engine: a run cut short keeps what was measured
                report.write_json(args.out, result)
    print(f"file: {result['file_gib']:.2f} GiB")
    print(report.format_table(result["rows"], COLUMNS))
    failed = any(not r.get("ok", True) for r in result["checks"].get("numerics", {}).values() if isinstance(r, dict))
    return 1 if failed or result["errors"] else 0


def checks(args: argparse.Namespace) -> dict:
    """The numerics on real tensors and the kernels' crossovers, printed."""
    found = {"numerics": numerics(args.device, Path(args.sample) if args.sample else None),
             "crossovers": crossovers(args.device, SHAPES.get(args.shape, SHAPES["8b"]))}
    print(f"numerics (Triton on real tensors vs fp64): {found['numerics']}")
    crossed = found["crossovers"]
    print("crossovers (gemv to M, tiles to M, int8 gemv faster at M):", crossed.get("not_run") or {
        kind: (v["gemv_max"], v["dot_max"], v["int8_gemv_faster_at"]) for kind, v in crossed.items()})
    return found


def _embedded_file() -> Path:
    from pagellm.loader.default_model import default_model_path

    return default_model_path()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # a copied tree without .git: --commit says it
