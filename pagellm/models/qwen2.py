"""Qwen2: the Llama architecture with biases on q/k/v (not on o_proj).

Sliding-window layers (use_sliding_window + max_window_layers) come through
`config.layer_types`, which LlamaAttention already honours.
"""

from __future__ import annotations

from torch import nn

from pagellm.models.llama import AttentionOptions, LlamaForCausalLM, LlamaModel


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def build_backbone(config) -> nn.Module:
        return LlamaModel(config, AttentionOptions(qkv_bias=True, o_bias=False))
