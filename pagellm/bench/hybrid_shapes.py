"""The original documents' models as --load-format dummy configs for a device check (random weights, real
shapes): Qwen3.5-35B-A3B (Gated DeltaNet and gated attention, 256 experts) and Qwen3.5-27B (the same layout,
dense MLP), from their published configurations (the model cards: 40 / 64 layers, three Gated DeltaNet layers to
one of gated attention, 16 key and 32 / 48 value heads of 128 in the DeltaNet, 16 / 24 query and 2 / 4 KV heads of
256 in attention, a quarter of each head rotated, vocabulary 248320); "tiny-hybrid" rehearses them on a CPU, and
"qwen3.5-35b-a3b-4-layers" and "qwen3.5-27b-8-layers" measure their layers on one."""

from __future__ import annotations

from pathlib import Path

_LAYOUT = ["linear_attention"] * 3 + ["full_attention"]
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, linear_conv_kernel_dim=4, max_position_embeddings=4096,
               tie_word_embeddings=False)
HYBRID_SHAPES = {
    "tiny-hybrid": dict(model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=256,
                        rope_theta=10000.0),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, vocab_size=248320, rope_theta=10000000.0),
    # its first four layers (three DeltaNet, one attention) and a 32000 vocabulary: its layers on a CPU's memory
    "qwen3.5-35b-a3b-4-layers": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=4,
                                     num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                     linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                                     linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                                     moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=32000,
                                     rope_theta=10000000.0),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, intermediate_size=17408, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
                        vocab_size=248320, rope_theta=10000000.0),
    # its first eight layers and a 32000 vocabulary, as the 35B-A3B's four above
    "qwen3.5-27b-8-layers": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=8,
                                 num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                                 linear_num_value_heads=48, vocab_size=32000, rope_theta=10000000.0),
}
_ARCHITECTURES = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}


def write_hybrid_shape(name: str, directory: Path) -> Path:
    """A config.json of hybrid shape `name` in `directory` (a --load-format dummy model)."""
    from transformers import AutoConfig

    fields = dict(HYBRID_SHAPES[name])
    kind, theta = fields.pop("model_type"), fields.pop("rope_theta")
    layers = fields["num_hidden_layers"]
    AutoConfig.for_model(kind, **_COMMON, **fields, architectures=[_ARCHITECTURES[kind]],
                         layer_types=(_LAYOUT * layers)[:layers],
                         rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25},
                         ).save_pretrained(directory)
    return directory


def kv_fields(name: str) -> dict:
    """What the KV budget reads of the shape: only its attention layers hold K and V."""
    shape = HYBRID_SHAPES[name]
    return dict(shape, num_hidden_layers=shape["num_hidden_layers"] // len(_LAYOUT),
                hidden_size=shape["head_dim"] * shape["num_attention_heads"])
