"""Read a GGUF file: its tensors under HF names (its config: gguf_config.py, re-exported here).

The container itself (header, metadata, tensor table) is parsed in gguf_file.py.
Tensor data stays in one read-only memory map;
each tensor is dequantized with gguf.quants.dequantize only when it is yielded
(weights bound for quantized layers are read by row slices, or as int4 codes: gguf_quant.py).

llama.cpp's converter changes some weights on the way to GGUF; we undo each:
- `llama` arch: q_proj/k_proj rows are permuted for its interleaved rotary layout;
- `gemma3`: every RMSNorm weight is stored as `w + 1` (Gemma's norm computes x * (1 + w)).
Llama 3.1-style rope scaling comes as a tensor, rope_freqs.weight: it goes into the config (gguf_config.py), not
into the model's weights.
The MoE and hybrid families (qwen3moe, qwen3next, qwen35, qwen35moe) have their own metadata and many more
such transforms: gguf_hybrid.py.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from pagellm.kernels.build import native
from pagellm.kernels.cpu import gguf_blocks
from pagellm.loader import gguf_repack
from pagellm.kernels.reference.gguf_planes import dequantize as dequantize_planes, supports
from pagellm.loader.gguf_planes import planes_of
from pagellm.layers.quantized import GroupAffine
from pagellm.loader.gguf_file import PLAIN_DTYPES, GGUFHeader, GGUFTensor, dequantize, header_of, read_gguf_header
from pagellm.loader.gguf_config import ROPE_FREQS_TENSOR, SUPPORTED_ARCHITECTURES, load_gguf_config
from pagellm.loader.gguf_hybrid import (HYBRID_ARCHITECTURES, TensorRecipe, hybrid_recipes, read_recipe,
                                        recipe_weight_type)
from pagellm.loader.gguf_quant import EXACT_INT4_TYPES, LazyRows, group_affine_of
from pagellm.loader.model_configs import TextModelConfig
from pagellm.loader.repack_cache import RepackCache
from pagellm.models.registry import build_model, model_class

__all__ = ["GGUFHeader", "GGUFTensor", "read_gguf_header", "load_gguf_config", "iter_gguf_weights",
           "fill_block_cache", "gguf_weight_types", "unpermute_qk_rows", "SUPPORTED_ARCHITECTURES"]

# ---------------------------------------------------------------------------------------------
# Public API


def iter_gguf_weights(
    path: str | Path | GGUFHeader, config: TextModelConfig, progress: bool | None = None,
    quantized: Mapping[str, str] | None = None, blocks: RepackCache | None = None,
    parameters: Iterable[str] | None = None, dequantize_on: torch.device | None = None, kept_only: bool = False,
    level: str | None = native.DEFAULT_LEVEL,
) -> Iterator[tuple[str, torch.Tensor | GroupAffine | LazyRows]]:
    """Yield (HF name, float32 tensor) for every tensor of the file, dequantized one at a time.

    progress: show a tqdm bar; by default only when stderr is a terminal.
    quantized: {HF name: "int8" | "int4"} of the weights quantized layers will take. Those come as a GroupAffine
    (int4 codes, scale and offset per 32 weights) when bound for int4 and stored as Q4_0, Q4_1 or Q4_K, the
    formats that are exactly that; otherwise as LazyRows, dequantized a row slice at a time (gguf_quant.py).
    blocks: the file's entry of the repacked-blocks cache (loader/repack_cache.py): weights kept in their blocks
    ("gguf") come from it when it is whole, else are stored to it; None: repacked at every load.
    parameters: the HF names of the model's parameters (its state_dict's keys), when the caller has built it.
    dequantize_on: a device that dequantizes the matrices kept whole (a GPU, where the model runs: its blocks
    copied as planes and dequantized there by torch, the gguf package's values bit for bit, instead of by numpy
    on one host core); None: numpy on the host.
    kept_only: only the weights kept in blocks ("gguf"), for writing `blocks`' entry before any layer takes a
    weight (fill_block_cache).
    level: the native kernels' level that helps repack blocks (gguf_repack.repack's; None: numpy alone).
    """
    header = _weights_only(header_of(path))
    arch = header.architecture
    show = sys.stderr.isatty() if progress is None else progress
    quantized = quantized or {}
    completed = False
    try:
        if arch in HYBRID_ARCHITECTURES:
            yield from _iter_recipes(header, hybrid_recipes(header, config, _has_mtp(parameters)), show, quantized,
                                     blocks, kept_only, level)
        else:
            hf_names = _gguf_to_hf_names(header, config, parameters)  # every tensor has an HF name: checked first
            _check_dequantizable(header)
            for tensor in tqdm(header.tensors, desc=_progress_label(header, kept_only), unit="tensor",
                               disable=not show):
                if kept_only and quantized.get(hf_names[tensor.name]) != "gguf":
                    continue
                yield _hf_weight(tensor, hf_names[tensor.name], arch, config, quantized.get(hf_names[tensor.name]),
                                 blocks, dequantize_on, level)
                tensor.release()  # the consumer has built its weight from the file's pages: out of the resident set
        completed = True
    finally:  # a load that stops early leaves no entry
        if blocks is not None:
            blocks.commit() if completed else blocks.abandon()


def fill_block_cache(path: str | Path | GGUFHeader, config: TextModelConfig, quantized: Mapping[str, str],
                     blocks: RepackCache, parameters: Iterable[str] | None = None,
                     level: str | None = native.DEFAULT_LEVEL) -> None:
    """Write `blocks`' entry (a miss) from the file before a model takes any weight: each weight kept in blocks is
    repacked, stored and dropped in turn (a join group's members once the group is whole), so the load that
    writes the entry holds a layer's blocks at most, not the model's, and then maps the entry as every later
    load does. Arguments as iter_gguf_weights'; the entry is committed, or abandoned when a write failed (the
    rest of the file is then not repacked for nothing)."""
    for _ in iter_gguf_weights(path, config, quantized=quantized, blocks=blocks, parameters=parameters,
                               kept_only=True, level=level):
        if blocks.failed:  # the entry keeps what it needs of each weight: nothing else does
            break


def _progress_label(header: GGUFHeader, kept_only: bool) -> str:
    return f"{'Caching the blocks of' if kept_only else 'Loading'} {header.path.name}"


def _hf_weight(tensor: GGUFTensor, hf_name: str, arch: str, config: TextModelConfig, scheme: str | None,
               blocks: RepackCache | None = None, dequantize_on: torch.device | None = None,
               level: str | None = native.DEFAULT_LEVEL
               ) -> tuple[str, torch.Tensor | GroupAffine | LazyRows | gguf_blocks.GGUFWeight]:
    """(HF name, the weight as the layer taking it wants it) of one tensor of the file."""
    permuted = arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
    on_device = scheme is None and dequantize_on is not None and len(tensor.shape) == 2 and \
        supports(tensor.ggml_type, *tensor.shape)
    if scheme == "gguf_planes" or on_device:
        planes = planes_of(_block_rows(tensor, config if permuted else None), tensor.ggml_type, tuple(tensor.shape))
        return hf_name, dequantize_planes(planes.to(dequantize_on)) if on_device else planes  # [N, K] float32
    if scheme == "gguf":
        weight = blocks.get(tensor.name) if blocks is not None else None
        if weight is None:
            weight = _blocks_of(tensor, config if permuted else None, level)
            if blocks is not None:
                blocks.add(tensor.name, weight)
        return hf_name, weight
    if scheme == "int4" and tensor.ggml_type in EXACT_INT4_TYPES:
        weight = group_affine_of(tensor.data, tensor.ggml_type, tensor.shape)
    elif scheme is not None and not permuted and len(tensor.shape) == 2:
        weight = LazyRows(tensor.data, tensor.ggml_type, tensor.shape)
    else:
        weight = dequantize(tensor)  # [*shape] float32
    if permuted:
        n_heads = config.num_attention_heads if "attn_q" in tensor.name else config.num_key_value_heads
        unpermute = lambda rows: unpermute_qk_rows(rows, n_heads)  # noqa: E731
        weight = weight.map_rows(unpermute) if isinstance(weight, GroupAffine) else unpermute(weight)
    elif arch == "gemma3" and tensor.name.endswith("norm.weight"):
        weight = weight - 1.0  # llama.cpp stores Gemma's RMSNorm weight as w + 1
    return hf_name, weight


def _has_mtp(parameters: Iterable[str] | None) -> bool:
    """Whether the model built holds an MTP head (models/mtp.py), whose weights a hybrid file then gives."""
    return parameters is not None and "mtp.fc.weight" in parameters


def gguf_weight_types(path: str | Path | GGUFHeader, config: TextModelConfig,
                      parameters: Iterable[str] | None = None) -> dict[str, gguf.GGMLQuantizationType]:
    """{HF name: ggml type the file stores it in}, from the header alone (parameters: as iter_gguf_weights')."""
    header = _weights_only(header_of(path))
    if header.architecture in HYBRID_ARCHITECTURES:
        return {r.hf_name: recipe_weight_type(r) for r in hybrid_recipes(header, config, _has_mtp(parameters))}
    hf_names = _gguf_to_hf_names(header, config, parameters)
    return {hf_names[t.name]: t.ggml_type for t in header.tensors}


def _block_rows(tensor: GGUFTensor, permuted_in: TextModelConfig | None) -> np.ndarray:
    """A 2-D tensor's blocks by row [rows, bytes]; llama's q/k rows put back in HF's order (whole rows move)."""
    rows = np.asarray(tensor.data).reshape(tensor.shape[0], -1)
    if permuted_in is None:
        return rows
    n_heads = permuted_in.num_attention_heads if "attn_q" in tensor.name else permuted_in.num_key_value_heads
    return unpermute_qk_rows(torch.from_numpy(rows.copy()), n_heads).numpy()  # the map is read-only


def _blocks_of(tensor: GGUFTensor, permuted_in: TextModelConfig | None, level: str | None) -> gguf_blocks.GGUFWeight:
    """A 2-D tensor kept in its blocks, repacked for the CPU kernels."""
    rows = _block_rows(tensor, permuted_in)
    if permuted_in is not None:
        return gguf_repack.repack(rows, tensor.ggml_type, tuple(tensor.shape), level=level)
    # the file's pages leave the resident set chunk by chunk as they are repacked: a big tensor (a vocab-sized
    # embedding) is then never resident twice, as file pages and as blocks
    return gguf_repack.repack(rows, tensor.ggml_type, tuple(tensor.shape), consumed=tensor.release, level=level)


def _weights_only(header: GGUFHeader) -> GGUFHeader:
    """The header without rope_freqs.weight: load_gguf_config reads it into the config, it is no weight."""
    return dataclasses.replace(header, tensors=tuple(t for t in header.tensors if t.name != ROPE_FREQS_TENSOR))


def unpermute_qk_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's `LlamaModel.permute` of q_proj/k_proj rows.

    llama.cpp reorders each head's rows from HF's rotate-half layout (first half, second half)
    to interleaved pairs: w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2). We reshape the stored
    rows as (n_heads, d/2, 2, in) and swap back.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# Weights


def _gguf_to_hf_names(header: GGUFHeader, config: TextModelConfig,
                      parameters: Iterable[str] | None = None) -> dict[str, str]:
    """{gguf name: HF name}, from the parameter names of pagellm's model (HF's names, before any projections
    are joined) and gguf's TensorNameMap.

    TensorNameMap maps many HF spellings to each GGUF name, so it cannot be inverted alone; we ask it for the
    GGUF name of each parameter of the model, built on the meta device (no memory). Not HF's own model class:
    importing HF's modeling code costs the process more resident memory than the weights of a small model.
    parameters: the model's parameter names when the caller has built it (a build costs tens of ms at start-up).
    """
    if parameters is None:
        parameters = build_model(config, torch.float32).state_dict()  # on the meta device: no memory
    arch = gguf.MODEL_ARCH[header.architecture.upper()]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    mapping = {}
    for hf_name in parameters:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
    unmapped = [t.name for t in header.tensors if t.name not in mapping]
    if unmapped:
        raise ValueError(f"{str(header.path)!r}: tensors with no {model_class(config).__name__} parameter: "
                         f"{unmapped}")
    return mapping


def _check_dequantizable(header: GGUFHeader) -> None:
    """Fail before loading anything when a tensor's type has no dequantizer in the gguf package."""
    for ggml_type in {t.ggml_type for t in header.tensors}:
        _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        plain = ggml_type in PLAIN_DTYPES
        probe = np.zeros((1,), PLAIN_DTYPES[ggml_type]) if plain else np.zeros((1, type_size), np.uint8)
        try:
            gguf.quants.dequantize(probe, ggml_type)
        except NotImplementedError:
            names = [t.name for t in header.tensors if t.ggml_type == ggml_type]
            raise ValueError(
                f"{str(header.path)!r}: tensor {names[0]!r} (and {len(names) - 1} more) is "
                f"{ggml_type.name}, which the gguf package cannot dequantize"
            ) from None


def _iter_recipes(header: GGUFHeader, recipes: list[TensorRecipe], show: bool, quantized: Mapping[str, str],
                  blocks: RepackCache | None, kept_only: bool, level: str | None
                  ) -> Iterator[tuple[str, torch.Tensor | GroupAffine | LazyRows]]:
    """The recipes' tensors (kept_only: those kept in blocks only); those kept in blocks come from the cache's
    entry (under their HF names) when it is whole, else are stored to it."""
    _check_dequantizable(header)
    for recipe in tqdm(recipes, desc=_progress_label(header, kept_only), unit="tensor", disable=not show):
        scheme = quantized.get(recipe.hf_name)
        if kept_only and scheme != "gguf":
            continue
        weight = blocks.get(recipe.hf_name) if blocks is not None and scheme == "gguf" else None
        if weight is None:
            weight = read_recipe(recipe, scheme, level)
            if blocks is not None and isinstance(weight, gguf_blocks.GGUFWeight):
                blocks.add(recipe.hf_name, weight)
        yield recipe.hf_name, weight
        for source in recipe.sources:
            source.release()  # taken into the weight (or read lazily again, from the page cache): out of the RSS


