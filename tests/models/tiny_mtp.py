"""Tiny hybrid checkpoints with an MTP head (`mtp.*` weights, as Qwen3.5 / Qwen3-Next checkpoints ship them),
and the head's reference forward built from HF's own modules (HF's CausalLM classes leave the head out).

The head's decoder layer is layer L of the same family's model one full-attention layer longer, saved by HF
(its checkpoint names, experts per expert), renamed `mtp.layers.0.*`; fc and the three norms are HF's Linear and
the family's RMSNorm.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

from tests.models.tiny_checkpoints import HYBRID_CONFIGS, _jitter_hybrid, write_hybrid_checkpoint


class ReferenceHead(nn.Module):
    """vLLM's Qwen3-Next / Qwen3.5 MTP forward on HF modules: o = norm(layer(fc([norm_e(e) | norm_h(h)])))."""

    def __init__(self, hf_model, layer: nn.Module):
        super().__init__()
        config, norm_class = hf_model.config, type(hf_model.model.norm)
        self.model = hf_model
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.layer = layer
        self.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """tokens t_1 .. t_n and the model's hidden states h_0 .. h_{n-1} [n, E] -> o [n, E] (causal)."""
        n = len(tokens)
        embedded = self.model.model.embed_tokens(torch.tensor([tokens]))  # [1, n, E]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden[None])], -1))
        positions = torch.arange(n)[None]
        cos_sin = self.model.model.rotary_emb(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out)[0]

    @torch.no_grad()
    def greedy(self, prompt: list[int], k: int) -> tuple[int, list[int]]:
        """The model's next token after `prompt`, and the head's k greedy drafts after it."""
        hidden = self.model.model(torch.tensor([prompt])).last_hidden_state[0]  # [n, E], after the final norm
        token = int(self.model.lm_head(hidden[-1]).argmax())
        tokens, drafts = prompt[1:] + [token], []
        for _ in range(k):
            o = self.forward(tokens, hidden)
            drafts.append(int(self.model.lm_head(o[-1]).argmax()))
            tokens, hidden = tokens + drafts[-1:], torch.cat([hidden, o[-1:]])
        return token, drafts


def write_mtp_checkpoint(family: str, directory: Path, seed: int = 0) -> ReferenceHead:
    """The family's tiny hybrid checkpoint with an MTP head in `mtp.safetensors`; returns the head's reference
    (its model: the HF model of the checkpoint)."""
    config = HYBRID_CONFIGS[family]()
    setattr(config, "num_nextn_predict_layers" if family == "qwen3-next" else "mtp_num_hidden_layers", 1)
    hf_model = write_hybrid_checkpoint(family, directory, seed, config=config)
    layers = config.num_hidden_layers
    longer = copy.deepcopy(config)
    longer.num_hidden_layers, longer.layer_types = layers + 1, list(config.layer_types) + ["full_attention"]
    torch.manual_seed(seed + 1)
    donor = AutoModelForCausalLM.from_config(longer, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, param in donor.named_parameters():
            _jitter_hybrid(name, param)
    donor.save_pretrained(directory / "donor")
    head = ReferenceHead(hf_model, donor.model.layers[layers])
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.startswith(("model.", "layer.")):
                _jitter_hybrid(name, param)
    prefix = f"model.layers.{layers}."
    tensors = {f"mtp.{name}.weight" if name != "fc" else "mtp.fc.weight": getattr(head, name).weight
               for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    with safe_open(str(directory / "donor" / "model.safetensors"), "pt") as f:
        tensors |= {"mtp.layers.0." + key[len(prefix):]: f.get_tensor(key)
                    for key in f.keys() if key.startswith(prefix)}
    for path in (directory / "donor").iterdir():
        path.unlink()
    (directory / "donor").rmdir()
    save_file({name: t.detach().contiguous() for name, t in tensors.items()}, str(directory / "mtp.safetensors"))
    return head.eval()


_OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")  # what each block adds to the residual


def make_head_predict_the_model(directory: Path, noise: float = 0.0, seed: int = 0) -> None:
    """Rewrite the checkpoint so that its MTP head predicts the model's tokens: every block's output projection
    zero, so the model's next token is a function of its current one alone (lm_head(norm(embed(t)))), and the
    head fc = [I | 0] with the same norms (o_p = norm(embed(t_{p+1})): the model's next token after t_{p+1}).
    noise: N(0, noise) added to fc's identity, so that the head errs on some tokens."""
    generator = torch.Generator().manual_seed(seed)
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        for key, tensor in tensors.items():
            if key.endswith(_OUTPUTS):
                tensor.zero_()
            elif key == "mtp.fc.weight":
                hidden = tensor.shape[0]
                tensor.zero_()
                tensor[:, :hidden] = torch.eye(hidden) + noise * torch.randn(hidden, hidden, generator=generator)
            elif key == "mtp.pre_fc_norm_embedding.weight":
                tensor.zero_()  # zero-centred: a weight of 1
        if "mtp.norm.weight" in tensors:
            with safe_open(str(directory / "model.safetensors"), "pt") as f:
                tensors["mtp.norm.weight"] = f.get_tensor("model.norm.weight")
        save_file(tensors, str(file))
