"""`pagellm bench device-check | device-gguf`: the arguments of the prepared GPU runs (bench/device_check.py,
bench/device_gguf.py)."""

from __future__ import annotations

import argparse

from pagellm.bench.arguments import add_output_arguments, add_state_dtype_argument, int_list


def _names(text: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [s.strip() for s in text.split(",") if s.strip()]


def _add_rows_arguments(parser: argparse.ArgumentParser) -> None:
    """What both device runs share: the device, and llama-batched-bench's rows (B, PP, TG) in a dtype."""
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--npl", type=int_list, default=[1, 16, 64], help="batch sizes (default 1,16,64)")
    parser.add_argument("--pp", type=int, default=512, help="prompt tokens per sequence (default 512)")
    parser.add_argument("--tg", type=int, default=64, help="generated tokens per sequence (default 64)")
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each figure (median reported)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype (default auto: bfloat16 on CUDA)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    add_state_dtype_argument(parser)


def add_device_check_parser(kinds) -> None:
    """`bench device-check`: the GPU run for the model families and the step modes (bench/device_check.py)."""
    check = kinds.add_parser("device-check", help="parity, the Triton attention and speed rows on a device, "
                             "at real shapes with random weights (rehearse with --device cpu --shapes tiny)")
    _add_rows_arguments(check)
    check.add_argument("--shapes", type=_names,
                       default=["1b", "8b"], help="Llama shapes tiny, 1b, 8b; the hybrid ones tiny-hybrid, "
                       "qwen3.5-35b-a3b, qwen3.5-27b (default 1b,8b)")
    check.add_argument("--modes", type=_names, default=["eager", "graphs", "async", "graphs-async"],
                       help="step modes measured: eager, graphs, async, graphs-async (default all; graphs only on "
                            "CUDA)")
    check.add_argument("--skip-checks", action="store_true",
                       help="no parity, kernel or step-mode checks: the speed rows alone (a second run's)")
    check.add_argument("--verify-shape", default=None,
                       help="also time a B=1 verify step of 4 drafts against a decode step at this Llama shape, "
                            "both replayed from graphs (speculative decoding; default: not timed)")
    check.add_argument("--delta-prefill-shape", default=None,
                       help="also time the Gated DeltaNet prefill rule at this hybrid shape's heads: the Triton "
                            "kernel, torch a request at a time, fla-core where it imports (default: not timed)")
    check.add_argument("--moe-tiles-shape", default=None,
                       help="also time the grouped MoE launches' candidate tiles at this hybrid MoE shape and print "
                            "the fastest as kernels/gpu/moe_tiles.json entries (default: not timed)")
    check.add_argument("--peers", default="hf,hf-static",
                       help="hf (dynamic cache), hf-static, or none (default both)")
    check.add_argument("--kv-cache-memory", type=float, default=None, help="pagellm KV budget in GiB")
    check.add_argument("--serve-prompts", type=int, default=None,
                       help="requests of the serving run of each step mode, embedded model (default 32 on CUDA, "
                            "0 = none elsewhere)")
    check.add_argument("--serve-rate", type=float, default=8.0, help="their Poisson arrival rate, req/s (default 8)")
    check.add_argument("--serve-shape", default=None,
                       help="the serving run's model shape (default: the first Llama shape of --shapes, else 1b)")
    check.add_argument("--serve-shared-prefix", type=int, default=64,
                       help="tokens every request's prompt shares (default 64)")
    check.add_argument("--serve-max-seqs", type=int, default=16, help="the server's --max-num-seqs (default 16)")
    check.add_argument("--serve-rounds", type=int, default=1,
                       help="times the serving workload runs against each server, memory read after each (a soak)")
    add_output_arguments(check, "device-check", "write checks and rows to FILE.json")
    check.set_defaults(func=_run_device_check)


def add_device_gguf_parser(kinds) -> None:
    """`bench device-gguf`: the GPU run for GGUF blocks (bench/device_gguf.py)."""
    gguf = kinds.add_parser("device-gguf", help="GGUF blocks on a GPU: the Triton matmuls on real tensors, their "
                            "crossovers, and rows of a Q4_K_M file in blocks, dequantized, and llama.cpp's")
    _add_rows_arguments(gguf)
    gguf.add_argument("--shape", default="8b", help="shape of the file written: Llama tiny, 1b, 8b; Qwen3.5-MoE "
                      "tiny-hybrid, qwen3.5-35b-a3b (default 8b)")
    gguf.add_argument("--sample", default=None, help="a GGUF of real tensors for the numerics (--write-sample)")
    gguf.add_argument("--write-sample", default=None, metavar="FILE",
                      help="write a sample of a real GGUF's Q4_K, Q5_0 and Q6_K tensors to FILE, and stop")
    gguf.add_argument("--write-sample-from", default=None, metavar="GGUF",
                      help="the GGUF --write-sample reads (default: the embedded model's file)")
    gguf.add_argument("--llama-batched-bench", default=None, metavar="BIN",
                      help="llama.cpp's llama-batched-bench (a CUDA build) to run on the same file")
    gguf.add_argument("--engines", type=_names, default=["pagellm-gguf", "pagellm-dequantized", "llama.cpp"],
                      help="engines measured: pagellm-gguf, pagellm-dequantized, llama.cpp (that one only with "
                           "--llama-batched-bench; default all)")
    gguf.add_argument("--file", default=None, metavar="GGUF",
                      help="where the file is written, and kept; an existing one is reused (default: a temporary "
                           "file)")
    gguf.add_argument("--skip-checks", action="store_true",
                      help="no numerics or crossovers: the speed rows alone (a second run's)")
    gguf.add_argument("--commit", default=None, help="the commit the rows name (default: git's HEAD)")
    add_output_arguments(gguf, "device-gguf", "write checks and rows to FILE.json")
    gguf.set_defaults(func=_run_device_gguf)


def _run_device_check(args: argparse.Namespace) -> int:
    from pagellm.bench import device_check

    return device_check.main(args)


def _run_device_gguf(args: argparse.Namespace) -> int:
    from pagellm.bench import device_gguf

    return device_gguf.main(args)
