"""Tiny HF checkpoints of the MoE / hybrid Qwen families converted to GGUF the way llama.cpp's converter does.

`convert_to_gguf` is written from our reading of llama.cpp's conversion/qwen.py (Qwen2MoeModel,
Qwen3NextModel, _LinearAttentionVReorderBase, the Qwen3.5 MTP mixin); tensor names come from the gguf
package's own TensorNameMap, as the converter's do. Forward transforms, per HF tensor:

    experts.{e}.{gate,up,down}_proj   stacked per layer [X, I, E] (optionally gate+up fused, gate rows first)
    A_log                             ssm_a = -exp(A_log)
    dt_bias                           renamed dt_proj.bias (ssm_dt.bias)
    conv1d.weight [C, 1, K]           squeezed to [C, K]
    *norm.weight                      + 1 (hybrid families only; not linear_attn.norm)
    in_proj_qkvz (Qwen3-Next)         split into attn_qkv [Q | K | V] and attn_gate Z (or kept whole: ssm_in)
    Qwen3.5 value heads               grouped -> tiled order, when key heads != value heads

The loader under test must undo every one of them. Nothing here imports pagellm.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedModel

from tests.loader.gguf_builders import random_k_quant_blocks
from tests.models.tiny_checkpoints import HYBRID_CONFIGS, write_hybrid_checkpoint

T = gguf.GGMLQuantizationType
FAMILY_ARCH = {"qwen3-moe": "qwen3moe", "qwen3-next": "qwen3next", "qwen3.5": "qwen35", "qwen3.5-moe": "qwen35moe"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass
class Conversion:
    """Converter choices a real file may carry."""

    legacy_qkvz: bool = False  # Qwen3-Next: in_proj_qkvz kept whole as ssm_in (the first converter)
    fused_experts: bool = False  # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    recurrent_layers_array: bool = False  # {arch}.attention.recurrent_layers instead of full_attention_interval
    mtp_layers: int = 0  # junk MTP (nextn) layers appended and counted in block_count, as --mtp files do
    # (a checkpoint with a real head, tiny_mtp's mtp.safetensors: converted as the Qwen3.5 MTP mixin does)
    types: dict[str, T] = field(default_factory=dict)  # GGUF name -> storage type (default F32)
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # written as they are, F32
    drop_metadata: tuple[str, ...] = ()  # keys left out of the file (to test the loader's error)


def write_hf_checkpoint(family: str, directory: Path, seed: int = 0, **overrides) -> PreTrainedModel:
    """tiny_checkpoints' hybrid model, in the form a GGUF can hold: llama.cpp makes every layer MoE and
    always renormalises the router's top-k weights. Weights redrawn as write_hybrid_checkpoint does.
    `overrides`: config fields changed (e.g. sizes that K-quant blocks of 256 columns fit)."""
    config = HYBRID_CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    if hasattr(config, "norm_topk_prob"):
        config.norm_topk_prob = True
    return write_hybrid_checkpoint(family, directory, seed, config)


def tiled_from_grouped(rows: np.ndarray, key_heads: int, per_key: int, width: int, axis: int = 0) -> np.ndarray:
    """The converter's value-head reorder along `axis`: [Hk, r, width] -> [r, Hk, width]."""
    moved = np.moveaxis(rows, axis, 0)
    shape = moved.shape
    out = moved.reshape(key_heads, per_key, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(out, 0, axis)


def convert_to_gguf(hf_dir: Path, path: Path, conversion: Conversion | None = None) -> dict[str, np.ndarray]:
    """Write `path` from the checkpoint in `hf_dir`; returns {GGUF name: the float32 values as stored}."""
    conversion = conversion or Conversion()
    config = AutoConfig.from_pretrained(hf_dir)
    arch = FAMILY_ARCH[_family_of(config)]
    with safe_open(str(hf_dir / "model.safetensors"), framework="np") as f:
        hf = {name: f.get_tensor(name).astype(np.float32) for name in f.keys()}
    head = hf_dir / "mtp.safetensors"
    if head.exists():  # the MTP mixin: mtp.layers.i -> block L + i, fc and its norms -> the nextn names
        with safe_open(str(head), framework="np") as f:
            hf |= {_mtp_name(name, config.num_hidden_layers): f.get_tensor(name).astype(np.float32)
                   for name in f.keys()}
        conversion = dataclasses.replace(conversion, mtp_layers=1)
    tensors = _converted_tensors(arch, config, hf, conversion)
    if not head.exists():
        tensors.update(_mtp_tensors(config, conversion.mtp_layers))
    tensors.update(conversion.extra_tensors)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, config, conversion)
    for key in conversion.drop_metadata:
        del writer.kv_data[0][key]
    stored, rng = {}, np.random.default_rng(0)
    for name, values in tensors.items():
        qtype = conversion.types.get(name, T.F32)
        if qtype == T.F32:
            raw = stored[name] = np.ascontiguousarray(values, dtype=np.float32)
        else:
            raw = _blocks_of(values, qtype, rng)
            stored[name] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        writer.add_tensor(name, raw, raw_dtype=qtype if qtype != T.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _blocks_of(values: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of `values` (any leading dims): quantized by the gguf package, or for the K formats it cannot
    quantize, random valid blocks of the same shape (their values then replace the checkpoint's)."""
    if qtype not in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K):
        return gguf.quants.quantize(values, qtype)
    rows = values.reshape(-1, values.shape[-1])
    blocks = random_k_quant_blocks(rng, rows.shape[0], rows.shape[1], qtype)
    return blocks.reshape(*values.shape[:-1], -1)


def _family_of(config) -> str:
    return {"Qwen3MoeForCausalLM": "qwen3-moe", "Qwen3NextForCausalLM": "qwen3-next",
            "Qwen3_5ForCausalLM": "qwen3.5", "Qwen3_5MoeForCausalLM": "qwen3.5-moe"}[config.architectures[0]]


_NEXTN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head_norm"}


def _mtp_name(name: str, layers: int) -> str:
    """The converter's name of an MTP head tensor: its layer as block L + i (the model's names after), fc and
    the norms around it as blk.L.nextn.* (GGUF names already: the gguf package maps no nextn name)."""
    parts = name.split(".")
    if parts[1] == "layers":
        return f"model.layers.{layers + int(parts[2])}." + ".".join(parts[3:])
    return f"blk.{layers}.nextn.{_NEXTN[parts[1]]}.weight"


def _converted_tensors(arch: str, config, hf: dict[str, np.ndarray], conversion: Conversion) -> dict[str, np.ndarray]:
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers + 1)
    hybrid = arch != "qwen3moe"
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in hf.items():
        if (match := _EXPERT.match(name)) is not None:
            experts.setdefault((int(match[1]), match[3]), {})[int(match[2])] = w
            continue
        if name.startswith("blk."):  # an MTP head's fc and norms, named already; its norms stored + 1
            out[name] = w if name.endswith("eh_proj.weight") else w + 1.0
            continue
        if "linear_attn." in name and arch in ("qwen35", "qwen35moe"):
            w = _tile_value_heads(name, w, config)
        if name.endswith(".A_log"):
            w = -np.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in name:
            w = w.squeeze()
        elif hybrid and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1.0
        if name.endswith("in_proj_qkvz.weight") and not conversion.legacy_qkvz:
            out.update(_split_qkvz(name, w, config))
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {name}"
        out[gguf_name] = w
    for (layer, proj), by_expert in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    if conversion.fused_experts:
        for layer in range(config.num_hidden_layers):
            gate, up = out.pop(f"blk.{layer}.ffn_gate_exps.weight"), out.pop(f"blk.{layer}.ffn_up_exps.weight")
            out[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    return out


def _tile_value_heads(name: str, w: np.ndarray, config) -> np.ndarray:
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if hk == hv:
        return w
    r, dv, key_channels = hv // hk, config.linear_value_head_dim, 2 * hk * config.linear_key_head_dim
    if "in_proj_qkv." in name or "conv1d" in name:
        w = w.reshape(w.shape[0], -1) if "conv1d" in name else w  # conv: [C, 1, K] -> [C, K]
        return np.concatenate([w[:key_channels], tiled_from_grouped(w[key_channels:], hk, r, dv)])
    if "in_proj_z." in name:
        return tiled_from_grouped(w, hk, r, dv)
    if "in_proj_b." in name or "in_proj_a." in name or name.endswith(("A_log", "dt_bias")):
        return tiled_from_grouped(w, hk, r, 1)
    if "out_proj." in name:
        return tiled_from_grouped(w, hk, r, dv, axis=1)
    return w


def _split_qkvz(name: str, w: np.ndarray, config) -> dict[str, np.ndarray]:
    """HF rows: per key-head group [q dk | k dk | v r*dv | z r*dv] -> [Q | K | V] and Z, contiguous over heads."""
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    rv = config.linear_num_value_heads // hk * config.linear_value_head_dim
    groups = w.reshape(hk, 2 * dk + 2 * rv, -1)
    q, k, v, z = np.split(groups, [dk, 2 * dk, 2 * dk + rv], axis=1)
    layer = int(name.split(".")[2])
    flat = [part.reshape(-1, w.shape[1]) for part in (q, k, v, z)]
    return {f"blk.{layer}.attn_qkv.weight": np.concatenate(flat[:3]), f"blk.{layer}.attn_gate.weight": flat[3]}


def _mtp_tensors(config, count: int) -> dict[str, np.ndarray]:
    """A few tensors of each junk MTP layer, the kinds llama.cpp stores there (nextn + a decoder block)."""
    rng, hidden = np.random.default_rng(1), config.hidden_size
    out = {}
    for layer in range(config.num_hidden_layers, config.num_hidden_layers + count):
        out[f"blk.{layer}.nextn.eh_proj.weight"] = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32)
        out[f"blk.{layer}.nextn.enorm.weight"] = np.ones(hidden, dtype=np.float32)
        out[f"blk.{layer}.attn_norm.weight"] = np.ones(hidden, dtype=np.float32)
        out[f"blk.{layer}.attn_q.weight"] = rng.standard_normal((hidden, hidden)).astype(np.float32)
    return out


def _write_metadata(writer: gguf.GGUFWriter, arch: str, config, conversion: Conversion) -> None:
    head_dim = config.head_dim
    writer.add_block_count(config.num_hidden_layers + conversion.mtp_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if getattr(config, "intermediate_size", None) is not None:
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(config.bos_token_id)
    if arch != "qwen35":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch in ("qwen3next", "qwen35moe"):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch != "qwen3moe":
        _write_linear_attention_metadata(writer, arch, config, conversion)
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    if arch in ("qwen35", "qwen35moe"):
        writer.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default (text-only: unused)
    if conversion.mtp_layers:
        writer.add_nextn_predict_layers(conversion.mtp_layers)


def _write_linear_attention_metadata(writer: gguf.GGUFWriter, arch: str, config, conversion: Conversion) -> None:
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    recurrent = [t == "linear_attention" for t in config.layer_types]
    if conversion.recurrent_layers_array:
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent + [False] * conversion.mtp_layers)
        return
    interval = config.layer_types.index("full_attention") + 1
    assert recurrent == [(i + 1) % interval != 0 for i in range(len(recurrent))], "not an interval pattern"
    writer.add_full_attention_interval(interval)


# case id -> (family, how the file is written): between them every converter variant the loader reads
CASES = {
    "qwen3-moe": ("qwen3-moe", Conversion()),
    "qwen3-next": ("qwen3-next", Conversion(recurrent_layers_array=True)),
    "qwen3-next-ssm_in-fused": ("qwen3-next", Conversion(legacy_qkvz=True, fused_experts=True)),
    "qwen3.5-mtp": ("qwen3.5", Conversion(mtp_layers=1)),
    "qwen3.5-moe-mtp-fused": ("qwen3.5-moe", Conversion(mtp_layers=1, fused_experts=True)),
}


def write_k_quant_moe_gguf(directory: Path) -> str:
    """A Qwen3-MoE GGUF (three layers, eight experts of 256 x 256) whose experts are stored as a Q4_K_M file
    stores them: gate and up Q4_K, down Q6_K; the path of the file."""
    types = {f"blk.{i}.{name}.weight": kind for i in range(3) for name, kind in (
        ("ffn_gate_exps", T.Q4_K), ("ffn_up_exps", T.Q4_K), ("ffn_down_exps", T.Q6_K))}
    write_hf_checkpoint("qwen3-moe", directory / "hf", hidden_size=256, moe_intermediate_size=256,
                        intermediate_size=256)
    convert_to_gguf(directory / "hf", directory / "model.gguf", Conversion(types=types))
    return str(directory / "model.gguf")
