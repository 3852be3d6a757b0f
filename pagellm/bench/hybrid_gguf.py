"""A Qwen3.5-MoE GGUF written where a device check runs (bench device-gguf --shape qwen3.5-35b-a3b): the published
shape (bench/hybrid_shapes.py), llama.cpp's qwen35moe tensor names and metadata (as loader/gguf_hybrid.py reads
them), Q4_K_M's mix of types, valid blocks of random codes with realistic scales.

Q4_K_M as llama.cpp's quantize applies it here: Q6_K for the output and, in the layers use_more_bits picks, for
attn_v and the (shared) experts' down projections; Q4_K for every other matrix whose rows are whole 256-column
super-blocks (Q8_0 where they are only whole 32-column blocks: the tiny rehearsal shape); F32 for the router, the
DeltaNet's per-head vectors and convolution, and the norms.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from pagellm.bench.gguf_files import add_placeholder_vocabulary, more_bits, random_blocks
from pagellm.bench.hybrid_shapes import HYBRID_SHAPES, write_hybrid_shape

T = gguf.GGMLQuantizationType
_F32 = ("ffn_gate_inp", "ssm_alpha", "ssm_beta", "ssm_conv1d", "ssm_a", "ssm_dt", "norm")
_WIDE = ("attn_v.", "ffn_down_exps", "ffn_down_shexp")  # Q6_K in the layers that get more bits


def tensor_type(name: str, cols: int, layers: int) -> T:
    """The type Q4_K_M stores GGUF tensor `name` (rows of `cols` values) in."""
    if any(part in name for part in _F32) or cols % 32:
        return T.F32
    if cols % 256:
        return T.Q8_0
    if name == "output.weight":
        return T.Q6_K
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    return T.Q6_K if layer >= 0 and any(part in name for part in _WIDE) and more_bits(layer, layers) else T.Q4_K


# an MTP head's own tensors (the converter's names, conversion/qwen.py), in the block after the model's
_NEXTN = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
          "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def _tensors(config, mtp: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape as torch holds it) of every tensor of the model `config` describes, with its MTP head's
    (`mtp`) as block num_hidden_layers."""
    from pagellm.models.registry import build_model

    layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, layers + 1)
    out = []
    for name, param in build_model(config, torch.bfloat16, "meta", mtp=mtp).state_dict().items():  # no memory
        shape = tuple(param.shape)
        if name in _NEXTN:
            out.append((f"blk.{layers}.{_NEXTN[name]}", shape))
            continue
        if name.startswith("mtp.layers."):
            index, rest = name[len("mtp.layers."):].split(".", 1)
            name = f"model.layers.{layers + int(index)}.{rest}"
        if name.endswith(".dt_bias"):
            out.append((f"blk.{name.split('.')[2]}.ssm_dt.bias", shape))
        elif name.endswith("conv1d.weight"):
            out.append((names.get_name(name, try_suffixes=(".weight",)), (shape[0], shape[2])))
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.append((f"{names.get_name(name)}.weight", shape))
        else:
            out.append((names.get_name(name, try_suffixes=(".weight", ".bias")), shape))
    return out


def write_hybrid_gguf(shape: str, path: Path, seed: int = 0, mtp: bool = False,
                      head_predicts: bool = False) -> dict[str, T]:
    """The Q4_K_M qwen35moe GGUF of hybrid shape `shape` at `path`; returns {tensor name: type}. mtp: with an
    MTP head (nextn_predict_layers 1); head_predicts: one made to predict the model (bench/mtp.py's way: every
    block's output projection zero blocks, the head's fc [I | 0] in F32 and its final norm the model's).

    Streamed: the tensor table first, then each tensor made and written in turn, so writing the whole 35B-A3B
    (about 20 GiB) holds one tensor at a time, not the file (docs/benchmarks/2026-11-29-moe-gguf-whole.md)."""
    from pagellm.loader.safetensors import load_hf_config

    with tempfile.TemporaryDirectory() as tmp:
        config = load_hf_config(write_hybrid_shape(shape, Path(tmp)))
    config = config.replace(mtp_num_hidden_layers=1) if mtp else config
    tensors = _tensors(config, mtp)
    types = {name: T.F32 if head_predicts and name.endswith(_FC) else  # the predicting head's fc is exactly [I | 0]
             tensor_type(name, dims[-1], config.num_hidden_layers) for name, dims in tensors}
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    _metadata(writer, config, HYBRID_SHAPES[shape])
    for name, dims in tensors:
        writer.add_tensor_info(name, *_stored_as(dims, types[name]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng, kept = np.random.default_rng(seed), {}
    for name, dims in tensors:
        data = _predicted(name, dims, types[name], kept) if head_predicts else None
        writer.write_tensor_data(data if data is not None else _random(rng, name, dims, types[name], kept))
    writer.close()
    return types


def _stored_as(dims: tuple[int, ...], kind: T) -> tuple[tuple[int, ...], np.dtype, int, T | None]:
    """add_tensor_info's (shape, dtype, bytes, raw type) of a tensor of `dims` stored as `kind`."""
    if kind == T.F32:
        return dims, np.dtype(np.float32), int(np.prod(dims)) * 4, None
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    stored = (*dims[:-1], dims[-1] // block_size * type_size)
    return stored, np.dtype(np.uint8), int(np.prod(stored)), kind


def _random(rng: np.random.Generator, name: str, dims: tuple[int, ...], kind: T, kept: dict) -> np.ndarray:
    """Tensor `name`'s random values (F32: those of its kind of weight) or blocks; the final norm's kept for a
    predicting head (_predicted)."""
    if kind != T.F32:
        return random_blocks(rng, kind, int(np.prod(dims[:-1])), dims[-1]).reshape(*dims[:-1], -1)
    values = (-rng.uniform(0.5, 8.0, dims) if name.endswith("ssm_a")  # -exp(A_log): decay rates
              else 1.0 + 0.1 * rng.standard_normal(dims) if "norm" in name
              else 0.02 * rng.standard_normal(dims))
    if name == "output_norm.weight":
        kept[name] = values
    return values.astype(np.float32)


_OUTPUTS = ("attn_output.", "ssm_out.", "ffn_down_exps.", "ffn_down_shexp.")
_FC = "nextn.eh_proj.weight"


def _predicted(name: str, dims: tuple[int, ...], kind: T, kept: dict) -> np.ndarray | None:
    """Tensor `name` of a head made to predict the model, where it differs from a random one; else None."""
    if any(part in name for part in _OUTPUTS):  # zero blocks (every scale zero): zero weights
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        return np.zeros((*dims[:-1], dims[-1] // block_size * type_size), np.uint8)
    if name.endswith(_FC):
        return np.eye(dims[0], dims[1], dtype=np.float32)
    if name.endswith("nextn.enorm.weight"):
        return np.ones(dims, np.float32)  # stored + 1: a zero-centred weight of 0
    if name.endswith("nextn.shared_head_norm.weight"):
        return kept["output_norm.weight"].astype(np.float32)
    return None


def _metadata(writer: gguf.GGUFWriter, config, fields: dict) -> None:
    """What loader/gguf_hybrid.py reads of a qwen35moe file (its docstring lists the keys)."""
    writer.add_name(f"pagellm-device-check-{fields['model_type']}")
    mtp_layers = getattr(config, "mtp_num_hidden_layers", 0)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    for add, value in ((writer.add_block_count, config.num_hidden_layers + mtp_layers),
                       (writer.add_context_length, 4096),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads), (writer.add_key_length, config.head_dim),
                       (writer.add_value_length, config.head_dim), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_freq_base, fields["rope_theta"]), (writer.add_expert_count, config.num_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_expert_shared_feed_forward_length, config.shared_expert_intermediate_size),
                       (writer.add_ssm_conv_kernel, config.linear_conv_kernel_dim),
                       (writer.add_ssm_state_size, config.linear_key_head_dim),
                       (writer.add_ssm_group_count, config.linear_num_key_heads),
                       (writer.add_ssm_time_step_rank, config.linear_num_value_heads),
                       (writer.add_ssm_inner_size, config.linear_value_head_dim * config.linear_num_value_heads),
                       (writer.add_full_attention_interval, 4),
                       (writer.add_rope_dimension_count, config.head_dim // 4),
                       (writer.add_rope_dimension_sections, [11, 11, 10, 0])):
        add(value)
    add_placeholder_vocabulary(writer, config.vocab_size)
