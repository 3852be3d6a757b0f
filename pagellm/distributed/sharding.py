"""Tensor / expert parallel sharding: which slice of each weight a rank holds, and where ranks sum.

A rank builds the model from a *local config* (heads, intermediate sizes and
linear-attention heads divided by the world size), so every module is born with
its shard's shapes; the checkpoint stream is then sliced by name before the
strict loader sees it. Nothing dense beyond the shard is kept.

    split (Megatron style)               weights                                  sum over ranks
    attention: heads                     q/k/v rows, o_proj columns               after o_proj
    Gated DeltaNet: key-head groups      in_proj rows, conv channels, A/dt,        after out_proj
                                         out_proj columns
    MLP / shared expert: intermediate    gate/up rows, down columns               after down
    routed experts, TP: intermediate     each expert's gate/up rows, down cols    after the MoE block
    routed experts, EP: whole experts    experts [r·X/W, (r+1)·X/W) only          after the MoE block

Norms, the router, the embedding and the LM head are replicated. A row-parallel
bias is kept on rank 0 only (zeros elsewhere) so the sum adds it once. With fewer
KV heads than ranks, each KV head is replicated on W/K ranks (as vLLM does).
With expert parallelism the shared expert is still split by intermediate size,
so each MoE block ends in exactly one all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.layers.moe import MoeExperts, SparseMoeBlock
from pagellm.layers.quantized import GroupAffine
from pagellm.models.llama import head_dim_of

Weight = torch.Tensor | GroupAffine


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    world_size: int
    expert_parallel: bool = False

    # What the loader asks of a shard (loader/model_loader.WeightShard): it reads files and knows no ranks.
    def model_config(self, hf_config):
        return local_config(hf_config, self)

    def install(self, model: nn.Module, hf_config) -> None:
        if self.expert_parallel:
            install_expert_parallel(model, hf_config, self)

    def weights(self, weights: Iterable[tuple[str, Weight]], hf_config) -> Iterator[tuple[str, Weight]]:
        return shard_weights(weights, hf_config, self)


def local_config(hf_config, spec: ShardSpec):
    """A copy of the HF config with this rank's head counts and intermediate sizes; ValueError if indivisible."""
    world = spec.world_size
    # head_dim fixed before heads are divided (a config without one derives it from them)
    changes = {"head_dim": head_dim_of(hf_config)}
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    _require_divisible("num_attention_heads", heads, world)
    if kv_heads % world and world % kv_heads:
        raise ValueError(f"tensor_parallel_size {world} must divide num_key_value_heads {kv_heads} or be a "
                         f"multiple of it")
    changes.update(num_attention_heads=heads // world, num_key_value_heads=max(1, kv_heads // world))
    divided = ["intermediate_size", "shared_expert_intermediate_size", "linear_num_key_heads",
               "linear_num_value_heads"]
    if not spec.expert_parallel:
        divided.append("moe_intermediate_size")
    elif getattr(hf_config, "num_experts", 0):
        _require_divisible("num_experts", hf_config.num_experts, world)
    for name in divided:
        value = getattr(hf_config, name, None)
        if value:
            _require_divisible(name, value, world)
            changes[name] = value // world
    return hf_config.replace(**changes)


def _require_divisible(name: str, value: int, world: int) -> None:
    if value % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's {name} ({value})")


def install_expert_parallel(model: nn.Module, hf_config, spec: ShardSpec) -> None:
    """EP: each MoE block keeps experts [r·X/W, (r+1)·X/W) (built on meta, filled by the loader)."""
    per_rank = hf_config.num_experts // spec.world_size
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            full = module.experts
            with torch.device("meta"):
                experts = MoeExperts(per_rank, full.hidden_size, full.intermediate_size, hf_config.hidden_act)
            module.experts = experts.to(full.gate_up_proj.dtype)
            module.first_expert = spec.rank * per_rank


def install_all_reduce(model: nn.Module, all_reduce_) -> None:
    """Sum the partial outputs of every attention / linear-attention / MLP block over ranks, in place, as a
    forward hook on each block for the module path (a bound plan sums them itself: the runner plans with
    `all_reduce_`)."""
    def hook(module, args, output):
        return all_reduce_(output)

    for layer in model.model.layers:
        for name in ("self_attn", "linear_attn", "mlp"):
            block = getattr(layer, name, None)
            if block is not None:
                block.register_forward_hook(hook)


class VocabParallelLogits:
    """The runner's compute_logits when the LM head's rows (the vocabulary) are split over ranks; the head rank
    gathers the logits.

    The head weight stays replicated (the embedding lookup needs all rows; tied models share the
    table), but each rank multiplies only by its V/W rows, so the LM head's time, the largest single
    matmul of a small model, is split like every other layer's. Logits [N, V/W] per rank are gathered
    to rank 0 in fp32: N·V·4 bytes per step. Every rank then computes logits in every sampling step.
    """

    def __init__(self, model: nn.Module, state, own_rows: slice):
        self.model, self.state, self.own_rows = model, state, own_rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # rank 0: [N, V]; others: their [N, V/W]
        return self.state.gather_columns(self.model.compute_logits(hidden, self.own_rows).contiguous())


def vocab_parallel_logits(model: nn.Module, state) -> VocabParallelLogits | None:
    """Dense heads whose rows divide evenly over the ranks only (a quantized head stays whole on rank 0)."""
    head = model.model.embed_tokens if model.tie_word_embeddings else model.lm_head
    vocab = head.weight.shape[0] if isinstance(head, (nn.Linear, nn.Embedding)) else 0
    if not vocab or vocab % state.world_size:
        return None
    rows = vocab // state.world_size
    return VocabParallelLogits(model, state, slice(state.rank * rows, (state.rank + 1) * rows))


# ---- slicing the checkpoint stream ------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def shard_weights(weights: Iterable[tuple[str, Weight]], hf_config, spec: ShardSpec) -> Iterator[tuple[str, Weight]]:
    """This rank's slice of each (HF name, weight); weights of experts held elsewhere are dropped."""
    if spec.world_size == 1:
        yield from weights
        return
    rules = _Rules(hf_config, spec)
    for name, weight in weights:
        expert = _PER_EXPERT.match(name)
        if expert is not None:
            renamed = rules.expert(expert, weight)
            if renamed is not None:
                yield renamed
            continue
        yield name, rules.slice(name, weight)


class _Rules:
    def __init__(self, config, spec: ShardSpec):
        self.rank, self.world, self.ep = spec.rank, spec.world_size, spec.expert_parallel
        self.kv_heads = config.num_key_value_heads
        self.num_experts = getattr(config, "num_experts", 0)
        if getattr(config, "linear_num_key_heads", None):
            key_dim = config.linear_num_key_heads * config.linear_key_head_dim
            self.qkv_sections = (key_dim, key_dim, config.linear_num_value_heads * config.linear_value_head_dim)

    def part(self, weight: Weight, dim: int, parts: int | None = None, index: int | None = None) -> Weight:
        """Piece `index` (default: this rank) of `parts` (default: world size) equal pieces along `dim`."""
        parts, index = parts or self.world, self.rank if index is None else index
        return _take(weight, dim, parts, index)

    def slice(self, name: str, w: Weight) -> Weight:
        last = name.rsplit(".", 2)
        module, attr = last[-2], last[-1]
        if ".self_attn." in name:
            if module == "q_proj":
                return self.part(w, 0)
            if module in ("k_proj", "v_proj"):
                if self.kv_heads >= self.world:
                    return self.part(w, 0)
                return self.part(w, 0, self.kv_heads, self.rank * self.kv_heads // self.world)
            if module == "o_proj":
                return self.part(w, 1) if attr == "weight" else self.bias_once(w)
            return w  # q_norm / k_norm: per head dim, replicated
        if ".linear_attn." in name:
            if module in ("in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a"):
                return self.part(w, 0)  # contiguous per key-head group or per value head
            if module in ("in_proj_qkv", "conv1d"):  # [Q | K | V] channels: split each section
                return _cat_sections(w, self.qkv_sections, lambda s: self.part(s, 0))
            if attr in ("dt_bias", "A_log"):
                return self.part(w, 0)
            if module == "out_proj":
                return self.part(w, 1)
            return w  # the gated norm: per value-head dim, replicated
        if ".experts." in name:  # stacked experts [X, 2I, E] / [X, E, I]
            return self.stacked_experts(attr, w)
        if module in ("gate_proj", "up_proj") and (".mlp." in name or ".shared_expert." in name):
            return self.part(w, 0)
        if module == "down_proj" and (".mlp." in name or ".shared_expert." in name):
            return self.part(w, 1) if attr == "weight" else self.bias_once(w)
        return w  # embeddings, norms, the router, the LM head

    def bias_once(self, bias: torch.Tensor) -> torch.Tensor:
        return bias if self.rank == 0 else torch.zeros_like(bias)

    def stacked_experts(self, attr: str, w: torch.Tensor) -> torch.Tensor:
        if self.ep:
            return self.part(w, 0)
        if attr == "gate_up_proj":  # [X, 2I, E]: gate rows then up rows, split each
            gate, up = w.chunk(2, dim=1)
            return torch.cat([self.part(gate, 1), self.part(up, 1)], dim=1)
        return self.part(w, 2)  # down_proj [X, E, I]

    def expert(self, match: re.Match, w: Weight) -> tuple[str, Weight] | None:
        e, proj = int(match["expert"]), match["proj"]
        if not self.ep:
            return match.string, self.part(w, 1 if proj == "down_proj" else 0)
        per_rank = self.num_experts // self.world
        first = self.rank * per_rank
        if not first <= e < first + per_rank:
            return None
        return f"{match['prefix']}.{e - first}.{proj}.weight", w


def _cat_sections(w: Weight, sections: tuple[int, ...], take) -> Weight:
    if isinstance(w, GroupAffine):
        return _map_affine(w, lambda t: _cat_sections(t, sections, take))
    return torch.cat([take(s) for s in w.split(list(sections), dim=0)], dim=0)


def _take(w: Weight, dim: int, parts: int, index: int) -> Weight:
    if isinstance(w, GroupAffine):
        return _take_affine(w, dim, parts, index)
    size = w.shape[dim]
    if size % parts:
        raise ValueError(f"cannot split a weight of shape {tuple(w.shape)} into {parts} along dim {dim}")
    step = size // parts
    return w.narrow(dim, index * step, step).contiguous()


def _take_affine(w: GroupAffine, dim: int, parts: int, index: int) -> GroupAffine:
    """GGUF 4-bit codes: rows split freely; columns only at whole 32-column groups (else dequantized)."""
    if dim == 0:
        return _map_affine(w, lambda t: _take(t, 0, parts, index))
    groups = w.scale.shape[1]
    if groups % parts:
        return _take(w.dequantize(), 1, parts, index)
    return GroupAffine(_take(w.q, 1, parts, index), _take(w.scale, 1, parts, index), _take(w.offset, 1, parts, index))


def _map_affine(w: GroupAffine, fn) -> GroupAffine:
    return GroupAffine(fn(w.q), fn(w.scale), fn(w.offset))
