"""Qwen3.5 text models: Qwen3_5ForCausalLM (dense) and Qwen3_5MoeForCausalLM.

Both are Qwen3-Next (models/qwen3_next.py) with these differences:
- Gated DeltaNet projections are separate: in_proj_qkv ([Q | K | V], contiguous),
  in_proj_z, in_proj_b, in_proj_a (Qwen3-Next fuses and interleaves them).
- Dense: every layer has a GatedMLP of `intermediate_size`.
  MoE: every layer has a SparseMoeBlock with a shared expert, and the router
  always renormalises its top-k weights (the config has no norm_topk_prob).
- RoPE is HF's multimodal (interleaved M-RoPE) rotary; for text every token has
  the same temporal/height/width position, which makes it plain partial RoPE.

Configs are Qwen3_5TextConfig / Qwen3_5MoeTextConfig (model_type qwen3_5_text /
qwen3_5_moe_text), the ones save_pretrained writes for these classes. Weights
saved from the vision-language wrapper (`model.language_model.` prefix,
`model.visual.*`, `mtp.*`) load too (see qwen3_next.checkpoint_renames); the
wrapper's own config (Qwen3_5ForConditionalGeneration) is not registered.
"""

from __future__ import annotations

from torch import nn

from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import SparseMoeBlock
from pagellm.models.qwen3_next import HybridForCausalLM


def qwen3_5_dense_mlp(config, layer_idx: int) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


def qwen3_5_moe_mlp(config, layer_idx: int) -> nn.Module:
    # getattr: the attribute is deleted from Qwen3_5MoeTextConfig (HF always renormalises).
    return SparseMoeBlock(config, normalize=getattr(config, "norm_topk_prob", True), shared_expert=True)


class Qwen3_5ForCausalLM(HybridForCausalLM):
    fused_projections = False
    mlp_factory = staticmethod(qwen3_5_dense_mlp)


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    fused_projections = False
    mlp_factory = staticmethod(qwen3_5_moe_mlp)
