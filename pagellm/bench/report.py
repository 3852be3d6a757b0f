"""Output shared by the benches: aligned tables, JSON / CSV rows, PNG plots, machine description."""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Column:
    key: str  # key in the row dict (and in JSON / CSV)
    header: str  # printed header
    fmt: str = "{}"  # format of one value

    def render(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        return "-" if value is None else self.fmt.format(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A Markdown table (as llama-batched-bench prints), right-aligned, one line per row."""
    cells = [[c.render(row) for c in columns] for row in rows]
    widths = [max([len(c.header)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    header = "| " + " | ".join(c.header.rjust(w) for c, w in zip(columns, widths)) + " |"
    rule = "|-" + "-|-".join("-" * w for w in widths) + "-|"
    body = ["| " + " | ".join(v.rjust(w) for v, w in zip(line, widths)) + " |" for line in cells]
    return "\n".join([header, rule, *body])


def write_rows(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write rows as a JSON list of objects (.json) or as CSV with a header line (.csv)."""
    path = _made_parent(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(list(rows), indent=2) + "\n")
    elif path.suffix == ".csv":
        keys: list[str] = []
        for row in rows:
            keys += [k for k in row if k not in keys]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    else:
        raise ValueError(f"--out {path}: the file name must end in .json or .csv")


def write_json(path: str | Path, data: dict) -> None:
    _made_parent(path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def _made_parent(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # bench-out/ on a first run
    return path


def check_out_path(path: str | Path | None) -> None:
    """Reject a bad --out before minutes of measuring, not after."""
    if path is not None and Path(path).suffix not in (".json", ".csv"):
        raise ValueError(f"--out {path}: the file name must end in .json or .csv")


def pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError(f"--plot needs matplotlib: {sys.executable} -m pip install matplotlib (`make peers` "
                         "installs it too)") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_series(path: str | Path, x: Sequence[float], series: dict[str, Sequence[float]], *,
                xlabel: str, ylabel: str, title: str) -> None:
    """One PNG: each named series against x, log2 x axis (batch sizes double)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    if len(set(x)) > 1 and min(x) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(x), [str(v) for v in x])
    finish_plot(plt, fig, ax, path, xlabel, ylabel, title)


def finish_plot(plt, fig, ax, path: str | Path, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, grid and legend shared by every bench plot; writes the PNG and frees the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(_made_parent(path))
    plt.close(fig)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def engine_dtypes(engine) -> str:
    """An engine's compute dtype, with its KV cache's where that differs: "float32, bfloat16 KV"."""
    kv = "" if engine.kv_cache_dtype == engine.dtype else f", {dtype_name(engine.kv_cache_dtype)} KV"
    return dtype_name(engine.dtype) + kv


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(dtype: str, kernels: str) -> dict[str, Any]:
    """The machine, and `kernels`: the engine's description of its CPU kernels (LLM.stats()["kernels"])."""
    import torch

    from pagellm.kernels.build import native

    simd = ("avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma", "avx_vnni", "asimd", "sve")
    return {
        "cpu": cpu_model(),
        "cpu_simd": [flag for flag in simd if flag in native.cpu_flags()],
        "kernels": kernels,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": dtype,
    }


def describe_machine(info: dict[str, Any]) -> str:
    return (f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads, "
            f"torch {info['torch']}, dtype {info['dtype']}\n"
            f"cpu flags: {' '.join(info.get('cpu_simd', []))}; kernels: {info.get('kernels', '?')}")
