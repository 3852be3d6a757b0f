"""Qwen3: the Llama architecture with per-head RMSNorm on q and k (before RoPE).

No biases unless `attention_bias`; head_dim comes from the config and need not
equal hidden_size / num_attention_heads.
"""

from __future__ import annotations

from torch import nn

from pagellm.models.llama import AttentionOptions, LlamaForCausalLM, LlamaModel


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def build_backbone(config) -> nn.Module:
        bias = getattr(config, "attention_bias", False)
        return LlamaModel(config, AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True))
