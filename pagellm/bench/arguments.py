"""Argument types shared by the bench commands."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from pagellm.config import STATE_DTYPES


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# Where --out / --plot files go unless a folder is named: ignored by git (.gitignore), so a bench run never
# leaves files among the tracked ones.
OUT_DIR = Path("bench-out")


def output_file(text: str) -> Path:
    """--out / --plot value: a bare file name lands in bench-out/; a path with a folder is used as given."""
    path = Path(text)
    if os.sep not in text and "/" not in text:  # "./rows.json" names a folder: kept
        path = OUT_DIR / path
    return path  # its folder is made when the file is written (bench/report.py), not at parsing


def add_output_arguments(parser: argparse.ArgumentParser, command: str, out_help: str,
                         plot_help: str | None = None) -> None:
    """--out [FILE] and --plot [FILE.png]; given without a value they write bench-out/<command>-<time>.json|png."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parser.add_argument("--out", type=output_file, nargs="?", const=f"{command}-{stamp}.json", default=None,
                        metavar="FILE", help=f"{out_help} (a bare name goes to {OUT_DIR}/)")
    if plot_help is not None:
        parser.add_argument("--plot", type=output_file, nargs="?", const=f"{command}-{stamp}.png", default=None,
                            metavar="FILE.png", help=f"{plot_help} (a bare name goes to {OUT_DIR}/)")


def add_collectives_arguments(parser) -> None:
    """`bench collectives`' arguments (here, not in the module that imports torch: every CLI start builds them)."""
    parser.add_argument("--world-size", type=int, default=2, help="ranks (local processes, Gloo on loopback)")
    parser.add_argument("--rows", type=int_list, default=[1, 8, 64, 512], help="N, rows combined (default 1,8,64,512)")
    parser.add_argument("--hidden", type=int, default=1024, help="E, hidden size (default 1024)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 10 combines; the best is reported")


def add_state_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=STATE_DTYPES,
                        help="hybrid models' recurrent state (default auto: the checkpoint's, else float32)")
