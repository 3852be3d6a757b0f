"""Multi-token prediction (MTP) heads of the Qwen3-Next / Qwen3.5 checkpoints: speculative decoding's drafter
(speculative_config method mtp, runner/mtp_drafter.py).

Legend: T = tokens, E = hidden.

The checkpoint's `mtp.*` weights (HF's CausalLM classes leave them out) are one more decoder layer with full
attention and the family's MLP (a MoE with a shared expert in the MoE models), fed by a projection of two
normed inputs; the embedding and the LM head are the model's own (config mtp_use_dedicated_embeddings false):

    x_p   = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)])      h_p: the model's last hidden state at p (after its
    o_p   = norm(layer(x_p))                                  final norm), the one whose logits gave t_{p+1}
    t_{p+2} ~ lm_head(o_p)

The layer attends over its own KV cache (one more attention layer in the model's paged blocks, at the same
positions). A second draft feeds o_p back as the hidden input with the first draft's token (vLLM's way with one
MTP layer, the only kind these checkpoints ship: the same layer again).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.layers.norm import RMSNorm


def mtp_layers_of(config) -> int:
    """MTP layers the checkpoint's config names: Qwen3.5's mtp_num_hidden_layers, Qwen3-Next's
    num_nextn_predict_layers (0: none)."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 0


class MultiTokenPredictor(nn.Module):
    def __init__(self, config, make_layer):
        """make_layer(layer_index): the family's decoder layer, full attention, at that index (the first after the
        model's layers: a MoE layer in the MoE families)."""
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if getattr(config, "mtp_use_dedicated_embeddings", False):
            raise ValueError("an MTP head with its own embeddings (mtp_use_dedicated_embeddings) is not supported")
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, unit_offset=True)
        if mtp_layers_of(config) != 1:  # Qwen3.5's and Qwen3-Next's have one; a second would need its own KV
            raise ValueError(f"an MTP head of {mtp_layers_of(config)} layers is not supported (one is)")
        self.layers = nn.ModuleList([make_layer(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, plan=None) -> torch.Tensor:
        """embedded [T, E]: the next tokens' embeddings; hidden [T, E]: the model's (or the last draft's) output at
        the same positions; plan: the layer and the final norm bound to the kernels (models/bound_layers
        .plan_backbone), else the modules run. Returns o [T, E], normed."""
        x = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1)  # [T, 2E]
        h, pending = self.fc(x), (None, None)  # [T, E]
        if plan is not None:
            return plan(h, [(cos, sin)], meta)  # [T, E]
        h, pending = self.layers[0](h, cos, sin, meta, pending)
        return self.norm.residual(h, *pending)[1]  # [T, E]
