"""The HF-transformers side of the parity tests: our model loaded from the same checkpoint, HF's logits
and HF's greedy continuation of a prompt."""

from __future__ import annotations

import torch

from pagellm.loader.model_loader import join_projections
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.models.registry import build_model


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load_ours(path) -> torch.nn.Module:
    """pagellm's model of an HF checkpoint directory, fp32, through the real loader, its projections joined as
    load_model does (the harness plans its layers as the runner does)."""
    model = build_model(load_hf_config(path), torch.float32)
    model.load_weights(iter_safetensors_weights(path))
    join_projections(model)
    return model


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [L, V]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate's greedy continuation (new tokens only)."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
