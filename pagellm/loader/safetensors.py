"""Read an HF checkpoint directory: config.json and *.safetensors.

    <dir>/config.json
    <dir>/model.safetensors                     single file, or
    <dir>/model.safetensors.index.json          sharded: {"weight_map": {name: shard file}}
    <dir>/model-00001-of-0000N.safetensors ...

Tensors are streamed one at a time from memory-mapped files, so a model built
on the meta device can take each as it comes (see models.llama.load_checkpoint_weights).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from pagellm.loader.model_configs import TextModelConfig, load_config_dir

_INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(path: str | Path) -> TextModelConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    return load_config_dir(path)


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's shard files: those the index names, or else every *.safetensors."""
    path = Path(path)
    index = path / _INDEX_FILE
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shard_names if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {str(path)!r}: {missing}")
        return [path / name for name in shard_names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {str(path)!r}")
    return files


def num_tensors(path: str | Path) -> int:
    """How many tensors iter_safetensors_weights will yield (reads only the file headers)."""
    total = 0
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def iter_safetensors_weights(path: str | Path, progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard, in file order.

    progress: show a tqdm bar; by default only when stderr is a terminal.
    """
    files = safetensors_files(path)
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=num_tensors(path) if show else None, desc="Loading weights", unit="tensor",
              disable=not show) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)
