"""`pagellm bench batched | compare | serve`: argument parsing and printing; the measuring lives beside it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagellm.bench.arguments import (add_collectives_arguments, add_output_arguments, add_state_dtype_argument,
                                     int_list)
from pagellm.bench.device_arguments import add_device_check_parser, add_device_gguf_parser
from pagellm.bench.hybrid_shapes import HYBRID_SHAPES
from pagellm.eval.cli import add_model_mode_args, set_threads


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_model_mode_args(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="pagellm KV budget in GiB (default on a CPU: a quarter of available RAM, at most 4; on "
                             "a GPU: gpu_memory_utilization's, a quarter of the free memory in compare)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="pagellm K/V storage (default auto: float16 for a GGUF as stored, bfloat16 under another "
                             "auto float32, else the dtype)")


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device the engine runs on (default cpu)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights from --model's config.json, any shape without its weights "
                             "(vLLM's flag)")
    # unset, both follow the device as `pagellm serve` does (graphs and async on CUDA): the default is measured
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="no decode CUDA graphs (default: graphs on CUDA)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each step before the last one's tokens are read (default: where graphs replay)")


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: batched (llama-batched-bench), compare (vs peers), serve (vllm bench serve), "
                      "serve-compare (vs llama-server)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    batched = kinds.add_parser("batched", help="llama-batched-bench columns over a sweep of batch sizes")
    _add_common(batched)
    batched.add_argument("--npl", type=int_list, default=[1, 8, 32, 64], help="batch sizes B (default 1,8,32,64)")
    batched.add_argument("--pp", type=int_list, default=[128], help="prompt tokens per sequence (default 128)")
    batched.add_argument("--tg", type=int_list, default=[128], help="generated tokens per sequence (default 128)")
    batched.add_argument("--shared-prompt", action="store_true",
                         help="all B sequences share one prompt (the prefix cache computes it once)")
    batched.add_argument("--max-num-batched-tokens", type=int, default=None,
                         help="token budget per step (default max(npl)*max(pp): a row's prefill is one step)")
    batched.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    add_state_dtype_argument(batched)
    batched.add_argument("--state-snapshot-interval", type=int, default=None,
                         help="hybrid models: tokens between a prompt's state snapshots (default: the engine's)")
    batched.add_argument("--tensor-parallel-size", type=int, default=1,
                         help="ranks the model is split over (local worker processes share this host's cores)")
    batched.add_argument("--enable-expert-parallel", action="store_true", help="MoE: shard whole experts")
    _add_device(batched)
    batched.add_argument("--json-schema", default=None, metavar="FILE",
                         help="hold every second request's output to this JSON schema (the cost of grammar masks); "
                              "its output must be longer than TG tokens")
    add_output_arguments(batched, "batched", "write the rows to FILE.json or FILE.csv", "plot S_PP and S_TG against B")
    batched.set_defaults(func=_run_batched)

    compare = kinds.add_parser("compare", help="the same workloads on pagellm and peers, plus the roofline")
    _add_common(compare)
    add_state_dtype_argument(compare)
    compare.add_argument("--npl", type=int_list, default=[1, 32],
                         help="batch sizes; 1 is the single-stream workload (default 1,32)")
    compare.add_argument("--pp", type=int, default=128, help="prompt tokens per sequence (default 128)")
    compare.add_argument("--tg", type=int, default=32, help="generated tokens per sequence (default 32)")
    compare.add_argument("--repeats", type=int, default=3, help="measurements of each figure (median reported)")
    compare.add_argument("--peers", default="hf,llama.cpp",
                         help="comma-separated peers to try: hf (dynamic cache), hf-static (static cache, compiled "
                              "by transformers: its fastest on a GPU), llama.cpp (on the CPU) (default hf,llama.cpp)")
    _add_device(compare)
    compare.add_argument("--llama-threads", type=int, default=2, help="llama.cpp threads (default 2)")
    add_output_arguments(compare, "compare", "write figures, roofline and peers to FILE.json")
    compare.add_argument("--quick-roofline", action="store_true",
                         help="measure the roofline with small sizes (smoke tests: an order of magnitude only)")
    compare.set_defaults(func=_run_compare)

    add_device_check_parser(kinds)
    add_device_gguf_parser(kinds)

    accuracy = kinds.add_parser("accuracy", help="a mode's distance from the dense fp32 model of the same file "
                                "(top-1 agreement, KL, perplexity), beside llama.cpp's on the same text")
    _add_common(accuracy)
    accuracy.add_argument("--text", required=True, help="a plain-text file (e.g. /usr/share/common-licenses/GPL-3)")
    accuracy.add_argument("--positions", type=int, default=256, help="positions compared (default 256)")
    accuracy.add_argument("--peers", default="llama.cpp", help="llama.cpp, or none (default llama.cpp)")
    accuracy.add_argument("--llama-threads", type=int, default=2, help="llama.cpp threads (default 2)")
    accuracy.set_defaults(func=_run_accuracy)

    collectives = kinds.add_parser("collectives", help="combining partial [N, E] outputs over ranks: "
                                   "all-reduce vs all-to-all (the MoE expert-parallel choice)")
    add_collectives_arguments(collectives)
    collectives.set_defaults(func=_run_collectives)
    _add_state_dtype_parser(kinds)
    _add_serve_parsers(kinds)
    _add_speculative_parser(kinds)
    _add_mtp_parser(kinds)


def _add_mtp_parser(kinds) -> None:
    mtp = kinds.add_parser("mtp", help="speculative decoding from a hybrid model's MTP head at a real shape: a "
                           "head made to predict the model (the bound) and one that misses (the cost), beside plain")
    mtp.add_argument("--shape", default="qwen3.5-35b-a3b-4-layers", choices=sorted(HYBRID_SHAPES),
                     help="the hybrid shape (default %(default)s)")
    mtp.add_argument("--device", default="cpu", help="torch device the engines run on (default cpu)")
    mtp.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: the device's")
    mtp.add_argument("--npl", type=int_list, default=[1, 4], help="batch sizes B (default 1,4)")
    mtp.add_argument("--pp", type=int, default=128, help="prompt tokens per sequence (default 128)")
    mtp.add_argument("--tg", type=int, default=128, help="generated tokens per sequence (default 128)")
    mtp.add_argument("--k", type=int_list, default=[1, 2, 3], help="draft lengths of the predicting head")
    mtp.add_argument("--rounds", type=int, default=2, help="every run once per round (default 2)")
    mtp.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB (default 1)")
    mtp.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    add_output_arguments(mtp, "mtp", "write the rows and the summary to FILE.json")
    mtp.set_defaults(func=_run_mtp)


def _run_mtp(args: argparse.Namespace) -> int:
    from pagellm.bench import mtp

    return mtp.main(args)


def _add_state_dtype_parser(kinds) -> None:
    state = kinds.add_parser("state-dtype", help="a hybrid model's recurrent state in bf16 against fp32: the decode "
                             "rule's time per step on this CPU, and the outputs' drift by decay")
    state.add_argument("--npl", type=int_list, default=[1, 8, 32], help="requests a step (default 1,8,32)")
    state.add_argument("--layers", type=int, default=30, help="DeltaNet layers a step (default 30, the 35B-A3B's)")
    state.add_argument("--repeats", type=int, default=5, help="timed steps of each figure (median)")
    state.add_argument("--rounds", type=int, default=2, help="the two dtypes alternated this many times")
    state.add_argument("--tokens", type=int, default=4096, help="decode tokens of each drift row (default 4096)")
    state.add_argument("--decays", type=lambda text: [float(x) for x in text.split(",")],
                       default=[0.9, 0.99, 0.999, 0.9999], help="decays e^g of the drift rows")
    state.add_argument("--seed", type=int, default=0)
    add_output_arguments(state, "state-dtype", "write the rows to FILE.json")
    state.set_defaults(func=_run_state_dtype)


def _run_state_dtype(args: argparse.Namespace) -> int:
    from pagellm.bench import state_dtype

    return state_dtype.main(args)


def _add_speculative_parser(kinds) -> None:
    spec = kinds.add_parser("speculative", help="speculative decoding at B=1 (code edit, summary, prose) and B=32: "
                                                "pagellm with and without it, llama-server with its n-gram kinds")
    spec.add_argument("--model", default=None, help="the GGUF file both serve (default: the embedded model)")
    spec.add_argument("--spec-config", default='{"method": "ngram"}',
                      help="pagellm's --speculative-config (default %(default)s)")
    spec.add_argument("--llama-server", default=None, metavar="PATH",
                      help="the llama-server binary (`make peers` builds it under ~/.cache/llama-cpp-peer); "
                           "without it, pagellm only")
    spec.add_argument("--llama-spec-types", default="ngram-simple,ngram-mod",
                      help="llama-server --spec-type values to run, comma-separated (default %(default)s; "
                           "ngram-map-k dropped its connection mid-run in the build measured)")
    spec.add_argument("--llama-spec-args", default="", help="more llama-server flags for its speculative runs")
    spec.add_argument("--text", default="/usr/share/common-licenses/GPL-3",
                      help="the text whose preamble the summary workload gives (default %(default)s)")
    spec.add_argument("--threads", type=int, default=2, help="llama-server threads (default %(default)s)")
    spec.add_argument("--output-len", type=int, default=256, help="tokens per request (default %(default)s)")
    spec.add_argument("--repeats", type=int, default=2, help="B=1 requests per workload (default %(default)s)")
    spec.add_argument("--batch", type=int, default=32, help="requests at once in the batch run (default %(default)s)")
    spec.add_argument("--ctx", type=int, default=2048, help="context tokens per sequence (default %(default)s)")
    spec.add_argument("--rounds", type=int, default=2, help="every server once per round (default %(default)s)")
    spec.add_argument("--prompt-ids", type=int, default=0, metavar="N",
                      help="each prompt N random token ids instead of its text (a file without a real vocabulary)")
    add_output_arguments(spec, "speculative", "write the rows (best round) and every round to FILE.json")
    spec.set_defaults(func=_run_speculative)


def _run_speculative(args: argparse.Namespace) -> int:
    from pagellm.bench import speculative

    return speculative.main(args)


def _add_serve_parsers(kinds) -> None:
    """`bench serve` (clients against a server) and `bench serve-compare` (pagellm and llama-server in turn)."""
    serve = kinds.add_parser("serve", help="streaming clients against an OpenAI-compatible server (vllm bench serve)")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (default %(default)s)")
    serve.add_argument("--start-server", action="store_true", help="start `pagellm serve` on a free port instead")
    serve.add_argument("--model", default=None, help="with --start-server: the model to serve (default embedded)")
    serve.add_argument("--serve-args", default="", help="with --start-server: more `pagellm serve` flags, one string")
    serve.add_argument("--api-key", default=None)
    add_workload_arguments(serve)
    add_output_arguments(serve, "serve", "write the summary and every request to FILE.json",
                         "CDF of TTFT and end-to-end latency")
    serve.set_defaults(func=_run_serve)

    both = kinds.add_parser("serve-compare", help="pagellm serve and llama-server on one GGUF, the same clients")
    both.add_argument("--llama-server", default=None, metavar="PATH",
                      help="the llama-server binary (default: on PATH, else the build `make peers` leaves under "
                           "~/.cache/llama-cpp-peer)")
    both.add_argument("--model", default=None, help="the GGUF file both serve (default: the embedded model)")
    both.add_argument("--slots", type=int, default=16, help="sequences at once, each server (default %(default)s)")
    both.add_argument("--ctx", type=int, default=1024, help="context tokens per sequence (default %(default)s)")
    both.add_argument("--threads", type=int, default=2, help="llama-server threads (default %(default)s)")
    both.add_argument("--servers", default="pagellm,llama-server",
                      help="which servers to run, in this order (default %(default)s)")
    both.add_argument("--serve-args", default="", help="more `pagellm serve` flags, one string")
    both.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    both.add_argument("--load", choices=["poisson", "burst", "sweep"], default="poisson")
    both.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[0.5, 1, 2, 4],
                      help="sweep: Poisson rates in requests/s, comma-separated (default 0.5,1,2,4)")
    both.add_argument("--ttft-bound", type=float, default=5.0, help="sweep: p99 TTFT bound in seconds")
    both.add_argument("--rounds", type=int, default=1,
                      help="run each load this many times in a row, each with prompts of its own (resident memory is read after each)")
    add_workload_arguments(both, workload="text", shared_prefix_len=300, output_len=64, request_rate=0.5)
    add_output_arguments(both, "serve-compare", "write every row and request to FILE.json",
                         "TTFT and ITL CDFs of each server")
    both.set_defaults(func=_run_serve_compare)


def add_workload_arguments(serve: argparse.ArgumentParser, workload: str = "random", shared_prefix_len: int = 0,
                           output_len: int = 32, request_rate: float = float("inf")) -> None:
    """The client side of bench serve / serve-compare: what is sent, how fast, and what counts tokens."""
    serve.add_argument("--tokenizer", default=None,
                       help="GGUF file or HF directory whose tokenizer builds and counts prompts (default: --model)")
    serve.add_argument("--workload", choices=["text", "random"], default=workload,
                       help="text: a shared prefix of real text plus a question each; random: random ids")
    serve.add_argument("--text", default=None, help="text workload: the file the shared prefix is cut from")
    serve.add_argument("--num-prompts", type=int, default=64)
    serve.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request (after the prefix)")
    serve.add_argument("--output-len", type=int, default=output_len,
                       help="tokens generated per request (ignore_eos; default %(default)s)")
    serve.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature of every request (default 0: greedy); top-k and min-p off")
    serve.add_argument("--top-p", type=float, default=1.0, help="top-p of sampled requests (default 1: off)")
    serve.add_argument("--shared-prefix-len", type=int, default=shared_prefix_len,
                       help="a system prompt of this many tokens shared by every request (default %(default)s)")
    serve.add_argument("--request-rate", type=float, default=request_rate,
                       help="Poisson arrival rate in requests/s (default %(default)s; inf: all at once)")
    serve.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    serve.add_argument("--disconnect-fraction", type=float, default=0.0,
                       help="share of requests whose client closes the stream after three chunks (default 0)")
    serve.add_argument("--chunk-timeout", type=float, default=300.0,
                       help="seconds a request waits for its next chunk before it counts as failed (default 300)")
    serve.add_argument("--seed", type=int, default=0)


def _run_accuracy(args: argparse.Namespace) -> int:
    from pagellm.bench import accuracy

    set_threads(args.threads)
    return accuracy.main(args)


def _run_batched(args: argparse.Namespace) -> int:
    from pagellm.bench import batched, report
    from pagellm.config import ParallelConfig

    report.check_out_path(args.out)
    set_threads(args.threads)
    engine = batched.build_engine(args.model, args.dtype, max(args.npl), max(args.pp), max(args.tg),
                                  block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                                  state_snapshot_interval=args.state_snapshot_interval,
                                  quantization=args.quantization, cpu_isa=args.cpu_isa,
                                  device=args.device, load_format=args.load_format,
                                  enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_prefix_caching=args.enable_prefix_caching,
                                  parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                                          enable_expert_parallel=args.enable_expert_parallel),
                                  with_tokenizer=args.json_schema is not None)
    try:
        return _report_batched(args, engine)
    finally:
        engine.shutdown()


def _json_schema(path: str | None):
    from pagellm.sampling_params import StructuredOutputs

    if path is None:
        return None
    try:
        return StructuredOutputs(json=Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--json-schema {path}: {exc.strerror}") from None


def memory_line(stats: dict) -> str:
    """Weights and the process's resident memory as loaded (KV pool still empty), against the model file."""
    mb = lambda n: "?" if n is None else f"{n / 1e6:.0f} MB"  # noqa: E731
    file_bytes = stats.get("model_file_bytes")
    ratio = f" ({stats['weight_bytes'] / file_bytes:.2f}x the file)" if file_bytes else ""
    return (f"memory: weights {mb(stats['weight_bytes'])}{ratio}, process resident after load "
            f"{mb(stats['rss_after_load_bytes'])}, model file {mb(file_bytes)}")


def _report_batched(args: argparse.Namespace, engine) -> int:
    from pagellm.bench import batched, report

    sched = engine.config.scheduler
    print(report.describe_machine(report.machine_info(report.dtype_name(engine.dtype), engine.kernels)))
    print(f"model: {engine.model_path}\n"
          f"engine: max_num_seqs {sched.max_num_seqs}, max_num_batched_tokens {sched.max_num_batched_tokens}, "
          f"block_size {engine.kv_cache.block_size}, KV blocks {engine.kv_cache.pool.num_blocks}, "
          f"prefix caching {'on' if args.enable_prefix_caching else 'off'}, shared prompt {args.shared_prompt}, "
          f"tensor parallel {engine.executor.world_size}")
    print(memory_line(engine.stats()) + "\n")
    columns = batched.COLUMNS + (batched.PREFIX_COLUMNS if args.shared_prompt else ())
    structured = _json_schema(args.json_schema)
    if structured is not None:
        print(f"JSON schema {args.json_schema} on every second request\n")
    rows, profiles = batched.run_sweep(engine, args.pp, args.tg, args.npl, args.shared_prompt, args.seed,
                                       on_row=lambda row: print(f"  done B={row['B']}", file=sys.stderr),
                                       structured=structured)
    print(report.format_table(rows, columns))
    print("\nstep instrumentation per phase (ms per step; copy = building input tensors)")
    print(report.format_table(profiles, batched.PROFILE_COLUMNS))
    stats = engine.stats()
    print("\nengine totals: " + ", ".join(
        f"{k} {stats[k]:.2f}" if isinstance(stats[k], float) else f"{k} {stats[k]}"
        for k in ("num_steps", "host_ms_per_step", "input_copy_ms_per_step", "model_ms_per_step",
                  "sample_ms_per_step", "host_syncs_per_step", "step_reuse_hits", "step_reuse_misses",
                  "step_reuse_rate", "step_message_bytes_per_step", "async_scheduling", "steps_launched_ahead",
                  "decode_graphs")))
    if args.out:
        report.write_rows(args.out, rows)
        print(f"wrote {args.out}")
    if args.plot:
        _plot_batched(args.plot, rows, args.shared_prompt, engine)
        print(f"wrote {args.plot}")
    return 0


def _plot_batched(path: Path, rows: list[dict], shared: bool, engine) -> None:
    import torch

    from pagellm.bench import report

    series: dict[str, list[float]] = {}
    combos = sorted({(r["PP"], r["TG"]) for r in rows})
    for pp, tg in combos:
        these = [r for r in rows if (r["PP"], r["TG"]) == (pp, tg)]
        suffix = f" (PP {pp}, TG {tg})" if len(combos) > 1 else ""
        series["S_PP prefill" + suffix] = [r["S_PP"] for r in these]
        series["S_TG decode" + suffix] = [r["S_TG"] for r in these]
    npl = [r["B"] for r in rows if (r["PP"], r["TG"]) == combos[0]]
    pp, tg = combos[0]
    title = (f"pagellm bench batched: {engine.model_path.name}, PP {pp}, TG {tg}"
             f"{', shared prompt' if shared else ''}\n{report.cpu_model()}, "
             f"{torch.get_num_threads()} threads, {report.dtype_name(engine.dtype)}")
    report.plot_series(path, npl, series, xlabel="B (parallel sequences)", ylabel="tokens / s", title=title)


def _run_collectives(args: argparse.Namespace) -> int:
    from pagellm.bench import collectives

    rows = collectives.run(args.world_size, args.rows, args.hidden, args.dtype, args.rounds)
    print(f"ms per combine of [N, {args.hidden}] {args.dtype} over {args.world_size} ranks (min of {args.rounds} x 10)")
    print(f"{'N':>6} {'allreduce':>10} {'all-to-all':>11}")
    for row in rows:
        print(f"{row['N']:>6} {row['allreduce']:>10.3f} {row['all-to-all']:>11.3f}")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from pagellm.bench import serve

    return serve.main(args)


def _run_serve_compare(args: argparse.Namespace) -> int:
    from pagellm.bench import serve_compare

    return serve_compare.main(args)


def _run_compare(args: argparse.Namespace) -> int:
    from pagellm.bench import compare

    set_threads(args.threads)
    return compare.main(args)
