"""A tiny Qwen3-Next Gated DeltaNet layer with random weights, unbound: the layer tests' subject (tests/layers,
tests/gpu)."""

from __future__ import annotations

import torch
from transformers import Qwen3NextConfig

from pagellm.layers.gated_delta_net import GatedDeltaNet


def tiny_gated_delta_net(seed: int = 0) -> GatedDeltaNet:
    """Hidden 48, 2 key heads of 16 and 4 value heads of 12 (two value heads a key head), 4 conv taps."""
    config = Qwen3NextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                             num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(seed)
    layer = GatedDeltaNet(config, fused_projections=True).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return layer
