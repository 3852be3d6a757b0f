"""HF architecture name -> model class, and `build_model` to construct one on the meta device."""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from pagellm.models.gemma3 import Gemma3ForCausalLM
from pagellm.models.llama import LlamaForCausalLM
from pagellm.models.qwen2 import Qwen2ForCausalLM
from pagellm.models.qwen3 import Qwen3ForCausalLM
from pagellm.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from pagellm.models.qwen3_moe import Qwen3MoeForCausalLM
from pagellm.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama + optional sliding window, read from the config
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Hybrid Gated DeltaNet / attention models: also expose state_layers() (runner-bound recurrent state).
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
})
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_CLASSES)


def model_class(hf_config) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"config has no `architectures`; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    name = architectures[0]
    if name not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return MODEL_CLASSES[name]


def build_model(hf_config, dtype: torch.dtype, device: torch.device | str = "cpu", mtp: bool = False) -> nn.Module:
    """An empty model on the meta device; `model.load_weights(...)` puts real weights on `device`. mtp: with the
    checkpoint's MTP head (models/mtp.py), a ValueError for a family without one."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, load_device=device)
        if mtp:
            if not hasattr(model, "add_mtp"):
                raise ValueError(f"speculative_config method mtp: {cls.__name__} has no MTP head (the Qwen3-Next "
                                 f"and Qwen3.5 families have)")
            model.add_mtp()
    return model.to(dtype=dtype).eval()
