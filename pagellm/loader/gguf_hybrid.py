"""GGUF files of the MoE and hybrid Qwen families: HF config fields from metadata, HF tensors from GGUF tensors.

    gguf arch   HF architecture          layers
    qwen3moe    Qwen3MoeForCausalLM      attention + MoE
    qwen3next   Qwen3NextForCausalLM     Gated DeltaNet / gated attention + MoE with a shared expert
    qwen35      Qwen3_5ForCausalLM       Gated DeltaNet / gated attention + dense MLP
    qwen35moe   Qwen3_5MoeForCausalLM    Gated DeltaNet / gated attention + MoE with a shared expert

Metadata, as llama.cpp's converter writes it (conversion/qwen.py) and its loaders read it
(src/models/qwen3next.cpp, qwen35moe.cpp):

    {arch}.expert_count, .expert_used_count       num_experts, num_experts_per_tok
    {arch}.expert_feed_forward_length             moe_intermediate_size
    {arch}.expert_shared_feed_forward_length      shared_expert_intermediate_size
    {arch}.ssm.conv_kernel, .ssm.state_size       linear_conv_kernel_dim, linear_key_head_dim
    {arch}.ssm.group_count, .ssm.time_step_rank   linear_num_key_heads, linear_num_value_heads
    {arch}.ssm.inner_size                         linear_num_value_heads * linear_value_head_dim
    {arch}.attention.recurrent_layers (bools)     layer_types; without it {arch}.full_attention_interval
                                                  (default 4): layer i is full attention iff (i + 1) % interval == 0
    {arch}.rope.dimension_count                   partial_rotary_factor * head_dim
    {arch}.nextn_predict_layers                   mtp_num_hidden_layers: MTP layers, counted in block_count and
                                                  stored last, read for a model built with its head (models/mtp.py)
                                                  as blk.{L}.nextn.{eh_proj, enorm, hnorm, shared_head_norm} (fc
                                                  and the three norms) and the layer's own tensors

llama.cpp's graphs for these families renormalise the router's top-k weights whatever the HF config said and
make every layer MoE, so the config we build says the same (norm_topk_prob, no mlp_only_layers).

Tensor transforms of the converter, each undone here (Qwen3-MoE has none):
- A_log is stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias;
- conv1d.weight [C, 1, K] is stored squeezed, [C, K];
- every RMSNorm weight except the DeltaNet output norm (linear_attn.norm, ssm_norm) is stored as w + 1:
  HF's zero-centred norm computes x/rms * (1 + w), llama.cpp's plain one x/rms * stored;
- Qwen3-Next in_proj_qkvz (rows interleaved per key-head group, [q k v z] per group) is stored as
  attn_qkv = [Q | K | V] and attn_gate = Z, each contiguous over heads; the first converter kept it whole
  as ssm_in, unchanged (in_proj_ba stays interleaved as ssm_ba either way);
- Qwen3.5, when key heads Hk != value heads: value heads are moved from grouped order (v-head g*r + j reads
  key head g) to tiled order (j*Hk + g), in the V rows of attn_qkv and ssm_conv1d, in the rows of attn_gate,
  ssm_beta, ssm_alpha, ssm_a and ssm_dt, and in the columns of ssm_out. Rows move back freely (blocks are
  per row); ssm_out's columns stay as stored and the layer puts its output in the file's order instead
  (OUT_PROJ_TILED), so the weight keeps its blocks;
- experts are stacked per layer: ffn_{gate,up,down}_exps [X, I, E] / [X, E, I], or ffn_gate_up_exps
  [X, 2I, E] (gate rows first). We yield them per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, and
  the model stacks them in its own dtype as they arrive (layers/moe.py), so no float32 copy of a whole
  layer's experts is made.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from pagellm.kernels.build import native
from pagellm.loader import gguf_repack
from pagellm.layers.quantized import GroupAffine
from pagellm.loader.gguf_file import GGUFHeader, GGUFTensor, dequantize
from pagellm.loader.gguf_planes import planes_of
from pagellm.loader.gguf_quant import EXACT_INT4_TYPES, LazyRows, group_affine_of
from pagellm.loader.model_configs import TextModelConfig

# gguf general.architecture -> (HF config model_type, HF architecture name)
HYBRID_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
_LINEAR_ATTENTION_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe"})  # also: norms stored as w + 1
_TILED_VALUE_HEAD_ARCHS = frozenset({"qwen35", "qwen35moe"})
# The config field saying a Gated DeltaNet's out_proj takes its inputs in the file's tiled value-head order: moving
# its columns to HF's order would take the weight out of its blocks (a dense copy read every token), where putting
# the layer's output in the file's order is a copy of T x Hv x dv activations. Off for tensor-parallel shards,
# which split out_proj's columns in HF's order (loader/model_loader.py).
OUT_PROJ_TILED = "linear_out_proj_tiled"
_DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's, for files that state neither the interval nor the layers
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# per-layer GGUF suffix -> HF suffix, for tensors stored as they are (apart from the norms' + 1)
# an MTP layer's own (converter's remapper, conversion/qwen.py): fc, and the zero-centred norms around it
_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",  # Qwen3-MoE
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # the hybrid families
    **{f"attn_{g}.{kind}": f"self_attn.{hf}_proj.{kind}"
       for g, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},  # Qwen3.5 dense MLP
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",  # Qwen3-Next, first converter
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",  # Qwen3-Next
    "ssm_norm.weight": "linear_attn.norm.weight",
}


# ---------------------------------------------------------------------------------------------
# Config


def hybrid_config_fields(header: GGUFHeader, common: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields of these families beyond `common` (gguf.py's, shared by every family).

    rope: gguf.py's rope_parameters of the file (base and scaling).
    """
    arch, md = header.architecture, header.metadata
    num_layers = common["num_hidden_layers"] - md.get(f"{arch}.nextn_predict_layers", 0)
    fields: dict[str, Any] = {"num_hidden_layers": num_layers, "hidden_act": "silu"}
    if md.get(f"{arch}.nextn_predict_layers", 0):
        fields["mtp_num_hidden_layers"] = md[f"{arch}.nextn_predict_layers"]
    if arch == "qwen35" or f"{arch}.feed_forward_length" in md:  # MoE files may leave it out
        fields["intermediate_size"] = header.required(f"{arch}.feed_forward_length")
    if arch != "qwen35":
        fields.update(_moe_fields(header))
    if arch in _LINEAR_ATTENTION_ARCHS:
        fields.update(_linear_attention_fields(header, num_layers))
        if arch in _TILED_VALUE_HEAD_ARCHS and fields["linear_num_value_heads"] != fields["linear_num_key_heads"]:
            fields[OUT_PROJ_TILED] = True  # ssm_out's columns stay in the file's order (GatedDeltaNet gathers)
        rotary_dims = md.get(f"{arch}.rope.dimension_count", common["head_dim"])  # llama.cpp: all, if absent
        rope = {**rope, "partial_rotary_factor": rotary_dims / common["head_dim"]}
    fields["rope_parameters"] = rope
    return fields


def _moe_fields(header: GGUFHeader) -> dict[str, Any]:
    arch = header.architecture
    fields = {
        "num_experts": header.required(f"{arch}.expert_count"),
        "num_experts_per_tok": header.required(f"{arch}.expert_used_count"),
        "moe_intermediate_size": header.required(f"{arch}.expert_feed_forward_length"),
    }
    if arch != "qwen3moe":
        fields["shared_expert_intermediate_size"] = header.required(f"{arch}.expert_shared_feed_forward_length")
    if arch != "qwen35moe":  # Qwen3.5-MoE's config has none of these: it always renormalises, every layer is MoE
        fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return fields


def _linear_attention_fields(header: GGUFHeader, num_layers: int) -> dict[str, Any]:
    arch, md = header.architecture, header.metadata
    value_heads, inner = header.required(f"{arch}.ssm.time_step_rank"), header.required(f"{arch}.ssm.inner_size")
    if inner % value_heads:
        raise ValueError(f"{str(header.path)!r}: {arch}.ssm.inner_size {inner} is not a multiple of "
                         f"{arch}.ssm.time_step_rank {value_heads} (the value heads)")
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = md.get(f"{arch}.full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    return {
        "linear_conv_kernel_dim": header.required(f"{arch}.ssm.conv_kernel"),
        "linear_key_head_dim": header.required(f"{arch}.ssm.state_size"),
        "linear_num_key_heads": header.required(f"{arch}.ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]],
    }


# ---------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorRecipe:
    """One HF tensor: the rows of `sources` stacked, picked by `rows`, then `finish`ed."""

    hf_name: str
    sources: tuple[GGUFTensor, ...]
    rows: torch.Tensor | None = None  # HF row r is stacked row rows[r]; None: every row, in order
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None  # on the float32 result: -1, log(-x), a reshape


def hybrid_recipes(header: GGUFHeader, config: TextModelConfig, mtp: bool = False) -> list[TensorRecipe]:
    """A recipe for every HF tensor the file holds, in file order; MTP layers are left out unless `mtp` (a model
    built with its head: their tensors under `mtp.*`).

    A tensor name this module does not know is a ValueError, raised before anything is read.
    """
    builder = _RecipeBuilder(header, config, mtp)
    recipes, unknown = [], []
    for tensor in header.tensors:
        made = builder.recipes_of(tensor)
        if made is None:
            unknown.append(tensor.name)
        else:
            recipes += made
    if unknown:
        raise ValueError(f"{str(header.path)!r}: tensors with no {config.architectures[0]} parameter: {unknown}")
    return recipes


def _planes(rows: np.ndarray, ggml_type: gguf.GGMLQuantizationType, shape: tuple[int, int], level: str | None):
    return planes_of(rows, ggml_type, shape)  # a GPU's layout: no CPU kernel lays it out


_KEEPERS = {"gguf": gguf_repack.repack, "gguf_planes": _planes}  # a scheme keeping blocks -> its layout


def read_recipe(recipe: TensorRecipe, scheme: str | None,
                level: str | None = native.DEFAULT_LEVEL) -> torch.Tensor | GroupAffine | LazyRows:
    """The HF tensor, float32; for a layer to be quantized (`scheme`), the int4 codes of an exact 4-bit
    format (rows rearranged as the recipe says) or rows read lazily, when no float transform is needed.
    level: the native kernels' level that helps repack blocks (gguf_repack.repack's)."""
    sources, rows = recipe.sources, recipe.rows
    if scheme in _KEEPERS and recipe.finish is None and len({s.ggml_type for s in sources}) == 1:
        stacked = np.concatenate([np.asarray(s.data).reshape(s.shape[0], -1) for s in sources])  # rows of blocks
        if rows is not None:
            stacked = stacked[rows.numpy()]
        return _KEEPERS[scheme](stacked, sources[0].ggml_type, (stacked.shape[0], sources[0].shape[1]), level=level)
    if scheme == "int4" and recipe.finish is None and all(s.ggml_type in EXACT_INT4_TYPES for s in sources):
        parts = [group_affine_of(s.data, s.ggml_type, s.shape) for s in sources]
        codes = parts[0] if len(parts) == 1 else GroupAffine(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.offset for p in parts]))
        return codes if rows is None else codes.map_rows(lambda t: t[rows])
    if scheme is not None and len(sources) == 1 and rows is None and recipe.finish is None:
        return LazyRows(sources[0].data, sources[0].ggml_type, sources[0].shape)
    values = torch.cat([dequantize(s) for s in sources]) if len(sources) > 1 else dequantize(sources[0])
    if rows is not None:
        values = values[rows]
    return recipe.finish(values) if recipe.finish is not None else values


def recipe_weight_type(recipe: TensorRecipe) -> gguf.GGMLQuantizationType:
    """The storage type `auto` quantization follows: the most precise of the sources'."""
    def bits(ggml_type: gguf.GGMLQuantizationType) -> float:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        return type_size * 8 / block_size

    return max((s.ggml_type for s in recipe.sources), key=bits)


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    return w - 1.0


def _log_of_negated(ssm_a: torch.Tensor) -> torch.Tensor:
    return torch.log(-ssm_a)  # ssm_a = -exp(A_log)


def _as_router_row(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(1, -1)  # shared_expert_gate is Linear(hidden, 1): [1, E], whether stored [E] or [1, E]


def _with_channel_axis(w: torch.Tensor) -> torch.Tensor:
    return w.unsqueeze(1)  # conv1d [C, K] -> [C, 1, K]


def grouped_from_tiled(num_key_heads: int, per_key_head: int, width: int) -> torch.Tensor:
    """Row index that undoes the converter's grouped -> tiled value-head order (rows of `width` per head).

    Stored position (j, g) holds the HF head g * r + j, so HF row r = stored row index[r].
    """
    stored = torch.arange(num_key_heads * per_key_head * width).view(per_key_head, num_key_heads, width)
    return stored.transpose(0, 1).reshape(-1)  # [Hk, r, width]: HF order


def qkvz_rows(num_key_heads: int, key_dim: int, per_key_head: int, value_dim: int) -> torch.Tensor:
    """Row index of HF's in_proj_qkvz into stacked [attn_qkv; attn_gate] = [Q | K | V | Z]: per key-head
    group g, HF rows are [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)]."""
    q_rows, v_rows = num_key_heads * key_dim, num_key_heads * per_key_head * value_dim
    q = torch.arange(q_rows).view(num_key_heads, key_dim)
    v = torch.arange(v_rows).view(num_key_heads, per_key_head * value_dim)
    return torch.cat([q, q_rows + q, 2 * q_rows + v, 2 * q_rows + v_rows + v], dim=1).reshape(-1)


def _expert_rows(tensor: GGUFTensor, expert: int, start: int, count: int) -> GGUFTensor:
    """Rows [start, start + count) of one expert of a stacked [X, rows, cols] tensor, as a tensor of its own."""
    return GGUFTensor(f"{tensor.name}[{expert}]", tensor.ggml_type, (count, tensor.shape[2]),
                      tensor.data[expert, start:start + count])


_EXPERT_PROJECTIONS = {
    "ffn_gate_exps.weight": ("gate",),
    "ffn_up_exps.weight": ("up",),
    "ffn_down_exps.weight": ("down",),
    "ffn_gate_up_exps.weight": ("gate", "up"),  # gate rows first, as HF's gate_up_proj
}
# DeltaNet tensors with one row (or value) per value head, stored in tiled order by the Qwen3.5 converter
_PER_VALUE_HEAD = {"ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight",
                   "ssm_dt.bias": "dt_bias"}


class _RecipeBuilder:
    """The recipes of one GGUF tensor at a time: [] to leave it out, None when its name is unknown."""

    def __init__(self, header: GGUFHeader, config: TextModelConfig, mtp: bool = False):
        self.arch, self.config, self.mtp = header.architecture, config, mtp
        self.by_name = {t.name: t for t in header.tensors}
        self.layer_types = getattr(config, "layer_types", None) if self.arch in _LINEAR_ATTENTION_ARCHS else None
        self.value_rows = self.head_rows = self.qkv_rows = None  # None: stored in HF order
        if self.arch in _LINEAR_ATTENTION_ARCHS:
            key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
            per_key_head, value_dim = config.linear_num_value_heads // key_heads, config.linear_value_head_dim
            self.qkvz_rows = qkvz_rows(key_heads, key_dim, per_key_head, value_dim)
            if self.arch in _TILED_VALUE_HEAD_ARCHS and per_key_head > 1:
                self.value_rows = grouped_from_tiled(key_heads, per_key_head, value_dim)
                self.head_rows = grouped_from_tiled(key_heads, per_key_head, 1)
                self.qkv_rows = torch.cat([torch.arange(2 * key_heads * key_dim),
                                           2 * key_heads * key_dim + self.value_rows])

    def recipes_of(self, tensor: GGUFTensor) -> list[TensorRecipe] | None:
        if tensor.name in _GLOBAL_NAMES:
            return [self._stored(_GLOBAL_NAMES[tensor.name], tensor)]
        match = _LAYER_TENSOR.match(tensor.name)
        if match is None:
            return None
        layer, suffix = int(match[1]), match[2]
        prefix = f"model.layers.{layer}."
        if layer >= self.config.num_hidden_layers:  # an MTP (nextn) layer: HF's CausalLM classes leave it out
            if not self.mtp:
                return []
            prefix = f"mtp.layers.{layer - self.config.num_hidden_layers}."
            if suffix in _NEXTN_NAMES:  # fc and the norms around it: zero-centred norms stored + 1
                name = _NEXTN_NAMES[suffix]
                return [TensorRecipe(name, (tensor,), finish=_minus_one if "norm" in name else None)]
        if suffix in _LAYER_NAMES:
            return [self._stored(prefix + _LAYER_NAMES[suffix], tensor)]
        if suffix == "ffn_gate_inp_shexp.weight":
            return [TensorRecipe(prefix + "mlp.shared_expert_gate.weight", (tensor,), finish=_as_router_row)]
        if suffix in _EXPERT_PROJECTIONS and len(tensor.shape) == 3:
            return self._experts(prefix + "mlp.experts.", tensor, _EXPERT_PROJECTIONS[suffix])
        if self.layer_types is not None and layer < len(self.layer_types) and \
                self.layer_types[layer] == "linear_attention":
            return self._linear_attention(prefix + "linear_attn.", tensor, suffix)
        return None  # e.g. a fused attn_qkv in a full-attention layer, which the converter never writes

    def _stored(self, hf_name: str, tensor: GGUFTensor) -> TensorRecipe:
        """A tensor stored as HF has it, but for the zero-centred norms' + 1 (the converter's rule, on HF names)."""
        plus_one = (self.arch in _LINEAR_ATTENTION_ARCHS and hf_name.endswith("norm.weight")
                    and not hf_name.endswith("linear_attn.norm.weight"))
        return TensorRecipe(hf_name, (tensor,), finish=_minus_one if plus_one else None)

    @staticmethod
    def _experts(prefix: str, tensor: GGUFTensor, projections: tuple[str, ...]) -> list[TensorRecipe]:
        num_experts, rows = tensor.shape[0], tensor.shape[1] // len(projections)
        return [TensorRecipe(f"{prefix}{e}.{proj}_proj.weight", (_expert_rows(tensor, e, i * rows, rows),))
                for e in range(num_experts) for i, proj in enumerate(projections)]

    def _linear_attention(self, prefix: str, tensor: GGUFTensor, suffix: str) -> list[TensorRecipe] | None:
        if suffix == "attn_qkv.weight" and self.arch == "qwen3next":
            gate_name = tensor.name.replace("attn_qkv", "attn_gate")
            if gate_name not in self.by_name:
                raise ValueError(f"{tensor.name!r} comes without {gate_name!r}: both make in_proj_qkvz")
            return [TensorRecipe(prefix + "in_proj_qkvz.weight", (tensor, self.by_name[gate_name]), self.qkvz_rows)]
        if suffix == "attn_gate.weight" and self.arch == "qwen3next":
            return []  # read with attn_qkv, above
        if suffix == "attn_qkv.weight":
            return [TensorRecipe(prefix + "in_proj_qkv.weight", (tensor,), self.qkv_rows)]
        if suffix == "attn_gate.weight":
            return [TensorRecipe(prefix + "in_proj_z.weight", (tensor,), self.value_rows)]
        if suffix in _PER_VALUE_HEAD:
            return [TensorRecipe(prefix + _PER_VALUE_HEAD[suffix], (tensor,), self.head_rows)]
        if suffix == "ssm_a":
            return [TensorRecipe(prefix + "A_log", (tensor,), self.head_rows, _log_of_negated)]
        if suffix == "ssm_conv1d.weight":
            return [TensorRecipe(prefix + "conv1d.weight", (tensor,), self.qkv_rows, _with_channel_axis)]
        if suffix == "ssm_out.weight":  # its columns in HF's order only where the model does not take the file's
            columns = None if getattr(self.config, OUT_PROJ_TILED, False) else self.value_rows
            return [TensorRecipe(prefix + "out_proj.weight", (tensor,),
                                 finish=None if columns is None else lambda w: w[:, columns])]
        return None
