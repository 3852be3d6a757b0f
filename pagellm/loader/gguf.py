"""Read a GGUF file: an HF config from its metadata, and its tensors under HF names.

    header  magic "GGUF" | version u32 | tensor count u64 | kv count u64
    kv      key string | value type u32 | value            (kv count times)
    tensors name string | n_dims u32 | dims u64[n_dims] | ggml type u32 | offset u64
    data    aligned to general.alignment (32); each tensor at data_start + offset

We parse the header ourselves instead of with gguf.GGUFReader: the reader builds
several numpy views for every element of every metadata array, which takes ~10 s
for Gemma 3's 262,144-token vocabulary, against ~50 ms here (tested equal to the
reader's output in tests/loader). Tensor data stays in one read-only memory map;
each tensor is dequantized with gguf.quants.dequantize only when it is yielded
(weights bound for quantized layers are read by row slices, or as int4 codes: gguf_quant.py).

llama.cpp's converter changes some weights on the way to GGUF; we undo each:
- `llama` arch: q_proj/k_proj rows are permuted for its interleaved rotary layout;
- `gemma3`: every RMSNorm weight is stored as `w + 1` (Gemma's norm computes x * (1 + w)).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagellm.layers.quantized import GroupAffine
from pagellm.loader.gguf_quant import EXACT_INT4_TYPES, LazyRows, group_affine_of

# gguf general.architecture -> (HF config class, HF architecture name)
SUPPORTED_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),  # Mistral GGUFs say llama as well
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM"),
}

_GGUF_VERSIONS = (2, 3)  # v1 counted with 32-bit integers and is long gone
_DEFAULT_ALIGNMENT = 32
# metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
# the ggml types the file holds as plain numbers, viewed with their numpy dtype (as GGUFReader does);
# every other type (BF16 included) is viewed as uint8 rows of blocks
_PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}
# llama.cpp's default base of Gemma 3's sliding-window layers when the file does not state one
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
# llama.cpp's Gemma 3: every 6th layer attends globally, the other five use the sliding window
_GEMMA3_SLIDING_WINDOW_PATTERN = 6


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: the reverse of the file's dims
    data: np.ndarray = field(repr=False)  # read-only memmap view: typed for plain types, else uint8 blocks


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]  # scalars, strings, and numeric arrays as lists
    array_lengths: dict[str, int]  # every array's length; string arrays' contents are not read
    tensors: tuple[GGUFTensor, ...]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)


# ---------------------------------------------------------------------------------------------
# Public API


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file; tensor data is only memory-mapped, not read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in _GGUF_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"{str(path)!r} is GGUF version {version}{hint}; supported versions: {_GGUF_VERSIONS}")
    pos, metadata, lengths = 24, {}, {}
    for _ in range(n_kv):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], length, pos = _read_value(blob, pos + 4, value_type, key)
        if length is not None:
            lengths[key] = length
    if "general.architecture" not in metadata:
        raise ValueError(f"{str(path)!r} has no general.architecture in its metadata")
    table, pos = _read_tensor_table(blob, n_tensors, pos, path)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = tuple(_tensor_view(blob, data_start, *entry) for entry in table)
    metadata = {k: v for k, v in metadata.items() if v is not None}  # string arrays: lengths only
    return GGUFHeader(path, metadata, lengths, tensors)


def load_gguf_config(path: str | Path) -> PretrainedConfig:
    """The transformers config HF uses for this model family, rebuilt from GGUF metadata."""
    header = read_gguf_header(path)
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {str(path)!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if header.tensor("rope_freqs.weight") is not None:
        # llama.cpp stores Llama 3.1-style rope scaling as per-dimension factors, not as parameters
        raise ValueError(f"{str(path)!r}: rope_freqs.weight (llama3-style rope scaling) is not supported yet")
    config_class, hf_architecture = SUPPORTED_ARCHITECTURES[arch]
    fields = _common_fields(header)
    if arch == "gemma3":
        fields.update(_gemma3_fields(header, fields))
    else:
        fields["rope_parameters"] = _rope_parameters(header)
    return config_class(architectures=[hf_architecture], **fields)


def iter_gguf_weights(
    path: str | Path, config: PretrainedConfig, progress: bool | None = None,
    quantized: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor | GroupAffine | LazyRows]]:
    """Yield (HF name, float32 tensor) for every tensor of the file, dequantized one at a time.

    progress: show a tqdm bar; by default only when stderr is a terminal.
    quantized: {HF name: "int8" | "int4"} of the weights quantized layers will take. Those come as a GroupAffine
    (int4 codes, scale and offset per 32 weights) when bound for int4 and stored as Q4_0, Q4_1 or Q4_K, the
    formats that are exactly that; otherwise as LazyRows, dequantized a row slice at a time (gguf_quant.py).
    """
    header = read_gguf_header(path)
    arch = header.architecture
    hf_names = _gguf_to_hf_names(header, config)  # checks every tensor has an HF name, up front
    _check_dequantizable(header)
    show = sys.stderr.isatty() if progress is None else progress
    quantized = quantized or {}
    for tensor in tqdm(header.tensors, desc=f"Loading {header.path.name}", unit="tensor", disable=not show):
        permuted = arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
        scheme = quantized.get(hf_names[tensor.name])
        if scheme == "int4" and tensor.ggml_type in EXACT_INT4_TYPES:
            weight = group_affine_of(tensor.data, tensor.ggml_type, tensor.shape)
        elif scheme is not None and not permuted and len(tensor.shape) == 2:
            weight = LazyRows(tensor.data, tensor.ggml_type, tensor.shape)
        else:
            weight = _dequantize(tensor)  # [*shape] float32
        if permuted:
            n_heads = config.num_attention_heads if "attn_q" in tensor.name else config.num_key_value_heads
            unpermute = lambda rows: unpermute_qk_rows(rows, n_heads)  # noqa: E731
            weight = weight.map_rows(unpermute) if isinstance(weight, GroupAffine) else unpermute(weight)
        elif arch == "gemma3" and tensor.name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp stores Gemma's RMSNorm weight as w + 1
        yield hf_names[tensor.name], weight


def gguf_weight_types(path: str | Path, config: PretrainedConfig) -> dict[str, gguf.GGMLQuantizationType]:
    """{HF name: ggml type the file stores it in}, from the header alone."""
    header = read_gguf_header(path)
    hf_names = _gguf_to_hf_names(header, config)
    return {hf_names[t.name]: t.ggml_type for t in header.tensors}


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
# Config


def _common_fields(header: GGUFHeader) -> dict[str, Any]:
    md, arch = header.metadata, header.architecture

    def key(name: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{name}", default) if default is not None else _required(header, f"{arch}.{name}")

    embedding = header.tensor("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{str(header.path)!r} has no token_embd.weight tensor")
    hidden, n_heads = key("embedding_length"), key("attention.head_count")
    return {
        # the embedding's row count is what the weights need; metadata vocab_size may be absent
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),
        "head_dim": key("attention.key_length", hidden // n_heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        "tie_word_embeddings": header.tensor("output.weight") is None,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_parameters(header: GGUFHeader) -> dict[str, Any]:
    """HF rope_parameters: llama.cpp's base (default 10000) and its linear or YaRN scaling."""
    md, arch = header.metadata, header.architecture
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(md.get(f"{arch}.rope.freq_base", 1e4))}
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind is None and md.get(f"{arch}.rope.scale_linear", 1.0) != 1.0:  # older files
        kind, factor = "linear", md[f"{arch}.rope.scale_linear"]
    if kind in (None, "none"):
        return params
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{str(header.path)!r}: rope scaling type {kind!r} is not supported (linear, yarn)")
    params.update(rope_type=kind, factor=float(factor))
    if kind == "yarn":
        optional = {
            "original_max_position_embeddings": "rope.scaling.original_context_length",
            "attention_factor": "rope.scaling.attn_factor",
            "beta_fast": "rope.scaling.yarn_beta_fast",
            "beta_slow": "rope.scaling.yarn_beta_slow",
        }
        params.update({hf: md[f"{arch}.{k}"] for hf, k in optional.items() if f"{arch}.{k}" in md})
    return params


def _gemma3_fields(header: GGUFHeader, common: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3)."""
    md, n_layers = header.metadata, common["num_hidden_layers"]
    full = _rope_parameters(header)  # scaling (e.g. linear x8 on 4B+) applies to global layers only
    local_base = float(md.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))
    local = {"rope_type": "default", "rope_theta": local_base}
    pattern = md.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer files: one bool per layer, true = sliding
        sliding = [bool(p) for p in pattern]
    else:  # a period: layer i is global when (i + 1) % period == 0
        sliding = [(i + 1) % pattern != 0 for i in range(n_layers)]
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(hidden/heads)
    scalar = common["head_dim"]
    if n_layers == 62:
        scalar = common["hidden_size"] // common["num_attention_heads"]
    fields = {
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "sliding_window": _required(header, "gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
    }
    for hf_key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if f"gemma3.{hf_key}" in md:
            fields[hf_key] = md[f"gemma3.{hf_key}"]
    return fields


def _required(header: GGUFHeader, key: str) -> Any:
    if key not in header.metadata:
        raise ValueError(f"{str(header.path)!r}: metadata key {key} is missing")
    return header.metadata[key]


# ---------------------------------------------------------------------------------------------
# Weights


def _gguf_to_hf_names(header: GGUFHeader, config: PretrainedConfig) -> dict[str, str]:
    """{gguf name: HF name}, from the HF model's own parameter names and gguf's TensorNameMap.

    TensorNameMap maps many HF spellings to each GGUF name, so it cannot be inverted alone; we
    ask it for the GGUF name of each parameter of the HF model (built on the meta device).
    """
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    arch = gguf.MODEL_ARCH[header.architecture.upper()]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    mapping = {}
    for hf_name in hf_model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
    unmapped = [t.name for t in header.tensors if t.name not in mapping]
    if unmapped:
        raise ValueError(f"{str(header.path)!r}: tensors with no {type(hf_model).__name__} parameter: {unmapped}")
    return mapping


def _check_dequantizable(header: GGUFHeader) -> None:
    """Fail before loading anything when a tensor's type has no dequantizer in the gguf package."""
    for ggml_type in {t.ggml_type for t in header.tensors}:
        _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        plain = ggml_type in _PLAIN_DTYPES
        probe = np.zeros((1,), _PLAIN_DTYPES[ggml_type]) if plain else np.zeros((1, type_size), np.uint8)
        try:
            gguf.quants.dequantize(probe, ggml_type)
        except NotImplementedError:
            names = [t.name for t in header.tensors if t.ggml_type == ggml_type]
            raise ValueError(
                f"{str(header.path)!r}: tensor {names[0]!r} (and {len(names) - 1} more) is "
                f"{ggml_type.name}, which the gguf package cannot dequantize"
            ) from None


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.ggml_type)  # float32, torch order
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(values).reshape(tensor.shape)


# ---------------------------------------------------------------------------------------------
# Header parsing


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(blob: np.ndarray, pos: int, value_type: int, key: str) -> tuple[Any, int | None, int]:
    """(value, array length or None, position after it). String arrays come back as None."""
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        value = struct.unpack_from(fmt, blob, pos)[0]
        if value_type == _FLOAT32:  # shortest decimal of the float32: 1e-06, not 9.999999974752427e-07
            value = float(str(np.float32(value)))
        return value, None, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        value, pos = _read_string(blob, pos)
        return value, None, pos
    if value_type != _ARRAY:
        raise ValueError(f"GGUF metadata key {key!r} has unknown value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item_type in _SCALAR_FORMATS:
        fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
        return list(struct.unpack_from(fmt, blob, pos)), count, pos + struct.calcsize(fmt)
    if item_type != _STRING:
        raise ValueError(f"GGUF metadata key {key!r} is an array of type {item_type}, which is not supported")
    for _ in range(count):  # vocabularies and merges: walk over them, the tokenizer reads them itself
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return None, count, pos


def _read_tensor_table(blob: np.ndarray, count: int, pos: int, path: Path) -> tuple[list[tuple], int]:
    table = []
    for _ in range(count):
        name, pos = _read_string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        raw_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has unknown ggml type id {raw_type}") from None
        table.append((name, ggml_type, tuple(reversed(dims)), offset))  # GGUF dims run fastest first
    return table, pos


def _tensor_view(blob: np.ndarray, data_start: int, name: str, ggml_type, shape: tuple, offset: int) -> GGUFTensor:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_elements = int(np.prod(shape, dtype=np.int64))
    n_bytes = n_elements // block_size * type_size
    start = data_start + offset
    if start + n_bytes > blob.size:
        raise ValueError(f"GGUF file is truncated: tensor {name!r} ends past the end of the file")
    raw = blob[start : start + n_bytes]
    if ggml_type in _PLAIN_DTYPES:
        data = raw.view(_PLAIN_DTYPES[ggml_type]).reshape(shape)
    else:
        data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type))
    return GGUFTensor(name, ggml_type, shape, data)
