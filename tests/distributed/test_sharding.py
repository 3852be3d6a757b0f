"""Shard shapes and slices without any process group: what each rank holds must tile the full weight."""

from __future__ import annotations

import pytest
import torch

from pagellm.distributed.sharding import ShardSpec, local_config, shard_weights
from pagellm.layers.quantized import group_affine_from_float
from pagellm.loader.model_configs import LlamaConfig


def _config(**overrides) -> LlamaConfig:
    values = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=1)
    return LlamaConfig.from_dict({**values, **overrides})


def test_local_config_divides_heads_and_intermediate_and_keeps_head_dim():
    local = local_config(_config(), ShardSpec(1, 2))
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.head_dim) == (
        2, 1, 64, 16)


def test_indivisible_sizes_are_a_clear_error():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's num_attention_heads"):
        local_config(_config(num_key_value_heads=1), ShardSpec(0, 3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        local_config(_config(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), ShardSpec(0, 2))


def _shards(name: str, weight, config, world: int = 2):
    return [dict(shard_weights([(name, weight)], config, ShardSpec(r, world)))[name] for r in range(world)]


def test_column_and_row_parallel_slices_tile_the_weight():
    config = _config()
    q = torch.randn(64, 64)
    o = torch.randn(64, 64)
    assert torch.equal(torch.cat(_shards("model.layers.0.self_attn.q_proj.weight", q, config)), q)
    assert torch.equal(torch.cat(_shards("model.layers.0.self_attn.o_proj.weight", o, config), dim=1), o)
    bias = torch.randn(64)
    kept, zeroed = _shards("model.layers.0.mlp.down_proj.bias", bias, config)
    assert torch.equal(kept, bias) and not zeroed.any()  # summed over ranks: added once
    norm = torch.randn(64)
    assert all(torch.equal(s, norm) for s in _shards("model.layers.0.input_layernorm.weight", norm, config))


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head():
    config = _config(num_key_value_heads=2)
    k = torch.randn(32, 64)  # 2 kv heads of 16
    parts = _shards("model.layers.0.self_attn.k_proj.weight", k, config, world=4)
    assert [torch.equal(p, k[:16]) for p in parts] == [True, True, False, False]
    assert [torch.equal(p, k[16:]) for p in parts] == [False, False, True, True]


def test_quantized_codes_split_at_whole_groups():
    weight = torch.randn(64, 128)
    affine = group_affine_from_float(weight)
    parts = _shards("model.layers.0.self_attn.o_proj.weight", affine, _config())
    halves = [p.dequantize() for p in parts]
    assert torch.equal(torch.cat(halves, dim=1), affine.dequantize())


def test_expert_parallel_keeps_and_renumbers_local_experts():
    config = _config(num_experts=4)
    spec = ShardSpec(1, 2, expert_parallel=True)
    weights = [(f"model.layers.0.mlp.experts.{e}.up_proj.weight", torch.full((8, 64), float(e))) for e in range(4)]
    kept = dict(shard_weights(weights, config, spec))
    assert sorted(kept) == ["model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"]
    assert kept["model.layers.0.mlp.experts.0.up_proj.weight"][0, 0] == 2.0
