"""Peers for `pagellm bench compare`: the engines a user would otherwise pick, on the same weights.

Each peer runs B prompts of PP tokens and TG decode steps, greedy, and returns
the prefill time (until every sequence has its first token) and the decode
time (TG more tokens each), exactly what pagellm's batched bench measures.

- HF transformers `generate`: the model class of the checkpoint's architecture,
  given pagellm's loaded weights (so a GGUF needs no `from_pretrained(gguf_file=)`),
  batched with left padding, sdpa attention, the same dtype and torch threads.
- llama.cpp: bench/llama_cpp_peer.py.
"""

from __future__ import annotations

import time

import torch

from pagellm.loader.model_loader import checkpoint_state_dict


class HFTransformersPeer:
    """HF generate on pagellm's weights; `static`: with a static KV cache, which transformers compiles itself
    (torch.compile and CUDA graphs on a GPU: its fastest generate, the peer that matters there)."""

    name = "hf-transformers"

    def __init__(self, engine, static: bool = False, model=None):
        import transformers

        self.model = model if model is not None else self._on_pagellms_weights(engine)
        self.pad_token_id = 0
        self.device = engine.device
        self.generate_options = {"cache_implementation": "static"} if static else {}
        self.name = "hf-static" if static else type(self).name
        dtype = str(engine.dtype).removeprefix("torch.")
        cache = "static cache (compiled by transformers)" if static else "dynamic cache"
        self.description = f"transformers {transformers.__version__} generate, sdpa, {cache}, {dtype}"

    @staticmethod
    def _on_pagellms_weights(engine):
        from transformers import AutoModelForCausalLM

        with torch.device(engine.device):  # its init and buffers on the device (on the CPU: slow, and copied)
            model = AutoModelForCausalLM.from_config(transformers_config(engine.hf_config), dtype=engine.dtype,
                                                     attn_implementation="sdpa")
        # assign=True: HF's parameters become pagellm's tensors, so the weights are not held twice.
        missing, unexpected = model.load_state_dict(checkpoint_state_dict(engine.model), strict=False, assign=True)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"HF model does not match pagellm's weights: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        return model.eval()

    def run(self, prompts: list[list[int]], tg: int) -> tuple[float, float]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)  # left pad
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=tg + 1, min_new_tokens=tg + 1,
                                      do_sample=False, eos_token_id=None, pad_token_id=self.pad_token_id,
                                      streamer=clock, **self.generate_options)
        t_end = time.perf_counter()
        if out.shape[1] != width + tg + 1 or clock.first is None:
            raise RuntimeError(f"HF generate returned {out.shape[1] - width} tokens, expected {tg + 1}")
        return clock.first - t0, t_end - clock.first


class _FirstTokenClock:
    """A generate() streamer that only notes when the first generated tokens arrive."""

    def __init__(self):
        self.puts = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def transformers_config(config):
    """transformers' config class of pagellm's config (loader/model_configs.py), for the HF peers."""
    from transformers import AutoConfig

    fields = config.to_dict()
    if fields.get("layer_types") is None:  # a family without them: transformers' caches read a None as a list
        fields.pop("layer_types", None)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
