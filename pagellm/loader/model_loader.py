"""Load a model and its tokenizer from a GGUF file, an HF checkpoint directory, or the embedded default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.loader.gguf import iter_gguf_weights, load_gguf_config
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.loader.tokenizer import Tokenizer, load_tokenizer
from pagellm.models.registry import build_model


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: object  # transformers PretrainedConfig
    tokenizer: Tokenizer | None
    path: Path


def resolve_model_path(model: str | None) -> Path:
    if model is None or model == "":
        from pagellm.loader.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {model} (expected a .gguf file or an HF checkpoint directory)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {model} is not a .gguf file; pass a GGUF file or an HF checkpoint directory")
    return path


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               with_tokenizer: bool = True) -> LoadedModel:
    path = resolve_model_path(model)
    if path.is_file():
        hf_config = load_gguf_config(path)
        weights = iter_gguf_weights(path, hf_config)
    else:
        hf_config = load_hf_config(path)
        weights = iter_safetensors_weights(path)
    net = build_model(hf_config, dtype, device)
    net.load_weights(weights)
    net.eval()
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return LoadedModel(net, hf_config, tokenizer, path)
