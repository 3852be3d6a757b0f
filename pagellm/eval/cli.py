"""`pagellm eval perplexity`: argument parsing; the method lives in eval/perplexity.py. The model-and-mode
arguments are `pagellm bench`'s too (bench sits above eval)."""

from __future__ import annotations

import argparse


def add_model_mode_args(parser: argparse.ArgumentParser) -> None:
    """The model and the mode it runs in (`pagellm bench`'s too)."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF checkpoint directory (default: the embedded Gemma 3 270M Q4_K_M)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="pagellm compute dtype (default auto, as the engine: float32 for a GGUF as stored; "
                             "else bfloat16 at avx512, float32 below)")
    parser.add_argument("--quantization", default="auto", choices=["none", "int8", "int4", "auto"],
                        help="pagellm weights kept quantized (see `pagellm serve --help`; default auto: GGUF as stored)")
    parser.add_argument("--cpu-isa", default=None, choices=["auto", "avx512", "avx2", "generic"],
                        help="pagellm's native kernel level (default: $PAGELLM_CPU_ISA or auto, the fastest here)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_eval_parser(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="how well a model (in a mode) predicts real text")
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)
    perplexity = kinds.add_parser(
        "perplexity", help="llama-perplexity's method: PPL +/- its error over windows of --ctx tokens, and "
                           "KL / top-1 agreement against the dense fp32 model of the same file")
    add_model_mode_args(perplexity)
    perplexity.add_argument("--text", required=True, help="a plain-text file (e.g. wiki.test.raw)")
    perplexity.add_argument("--ctx", type=int, default=512,
                            help="tokens per window; its second half is scored (default 512)")
    perplexity.add_argument("--chunks", type=_positive_int, default=None,
                            help="score at most this many windows (default: every whole window of the text)")
    perplexity.add_argument("--kl-base", default="dense", choices=["dense", "none"],
                            help="dense: also KL(dense fp32 || mode) and top-1 agreement on the same positions, "
                                 "the dense model held in memory beside the mode (default dense)")
    perplexity.set_defaults(func=_run_perplexity)


def _run_perplexity(args: argparse.Namespace) -> int:
    from pagellm.eval import perplexity

    set_threads(args.threads)
    return perplexity.main(args)
