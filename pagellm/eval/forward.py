"""One text through pagellm's own forward, outside the engine: the logits of every position it scores.

Shared by `pagellm eval perplexity` and `pagellm bench accuracy`. A sequence runs alone over a paged KV
cache of its own, prefilled in chunks as the engine does, so the figures are the engine's arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagellm.loader.model_loader import load_model
from pagellm.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig
from pagellm.runner.backend import Backend, choose_backend, device_kernels
from pagellm.models.bound_layers import PlanSettings, plan_model
from pagellm.loader.tokenizer import load_tokenizer
from pagellm.kernels.attention_metadata import AttentionMetadata

_BLOCK = 16  # tokens per KV block of the sequence's private cache


def mode_backend(path: Path | str | None, quantization: str = "auto", dtype: str | None = None,
                 kv_cache_dtype: str = "auto", kernels: KernelConfig | None = None) -> Backend:
    """The backend the engine would run `path` on, on CPU, in one mode (--quantization, --dtype,
    --kv-cache-dtype, the kernels' level): the same choose_backend, from the config `LLM(...)` builds, so the
    figures are the engine's dtypes and kernels ("auto": fp32 with fp16 K/V for a GGUF's blocks)."""
    config = EngineConfig(model=ModelConfig(model=None if path is None else str(path), dtype=dtype,
                                            quantization=quantization),
                          cache=CacheConfig(kv_cache_dtype=kv_cache_dtype), kernels=kernels or KernelConfig())
    return choose_backend(config)


def is_dense_mode(path: Path, quantization: str, dtype: torch.dtype) -> bool:
    """Whether the mode loads the dense fp32 reference model itself ("auto" keeps an HF checkpoint dense; its
    K/V may still be stored in bf16: see mode_backend)."""
    dense_weights = quantization == "none" or (quantization == "auto" and not path.is_file())
    return dense_weights and dtype == torch.float32


def load_mode(path: Path, quantization: str, dtype: torch.dtype,
              kernels: KernelConfig | None = None) -> torch.nn.Module:
    """The model of `path` on CPU in one mode (layouts for `kernels`' level). Quantization and dtype are always
    passed: the loader's defaults may differ by file type, and the dense reference must be dense whatever they
    are."""
    return load_model(str(path), dtype, torch.device("cpu"), with_tokenizer=False, quantization=quantization,
                      kernels=kernels).model


def load_dense_reference(path: Path, kernels: KernelConfig | None = None) -> torch.nn.Module:
    """The dense fp32 model of the same file (a GGUF's blocks dequantized): what every mode is measured against."""
    return load_mode(path, "none", torch.float32, kernels)


def tokenize_text(path: Path, text_file: str) -> tuple[list[int], int | None]:
    """The text's token ids with the model's tokenizer, and the BOS id it put first (None when it adds none)."""
    tokenizer = load_tokenizer(path, ModelConfig().cache_dir)
    ids = tokenizer.encode(Path(text_file).read_text())
    bos = tokenizer.bos_token_id
    return ids, (bos if bos is not None and ids[:1] == [bos] else None)


def pagellm_logits(model: torch.nn.Module, tokens: list[int], dtype: torch.dtype, chunk: int = 128,
                   first: int = 0, kv_cache_dtype: torch.dtype | None = None,
                   kernels: KernelConfig | None = None, narrow: torch.dtype | None = None) -> torch.Tensor:
    """[len(tokens) - first, V] fp32 logits of positions first .. end, one sequence prefilled `chunk` tokens
    per step; positions before `first` only build the cache (their logits are never computed). K/V are stored
    in `kv_cache_dtype` (default: `dtype`); the layers run as the engine's runner would plan them (`kernels`,
    `narrow`: PlanSettings.narrow)."""
    if getattr(model, "state_layers", list)():
        raise ValueError("this evaluation does not drive hybrid (recurrent-state) models yet")
    blocks = -(-len(tokens) // _BLOCK)
    device = next(model.parameters()).device  # the cache and the step's inputs where the weights are
    for layer in model.attention_layers():
        shape = (blocks, _BLOCK, layer.num_kv_heads, layer.head_dim)
        layer.bind_kv_cache(torch.zeros(shape, dtype=kv_cache_dtype or dtype, device=device),
                            torch.zeros(shape, dtype=kv_cache_dtype or dtype, device=device))
    kernels = kernels or KernelConfig()
    level, step_kernels, ops = device_kernels(device, kernels, dtype)  # as the weights' device's backend binds them
    plan = plan_model(model, PlanSettings(level, dtype, kv_cache_dtype or dtype, kernels.bound_layers,
                                          narrow=narrow, kernels=step_kernels, ops=ops)).bound
    table, out = list(range(blocks)), []
    with torch.inference_mode():
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            meta = AttentionMetadata.build([len(piece)], [start + len(piece)], [table], _BLOCK, device=device)
            hidden = model(torch.tensor(piece, device=device), torch.arange(start, start + len(piece), device=device),
                           meta, plan=plan)  # [T, E]
            if start + len(piece) > first:
                out.append(model.compute_logits(hidden[max(0, first - start):]).float())  # [T', V]
    return torch.cat(out)
