"""Peers for `pagellm bench compare`: the engines a user would otherwise pick, on the same weights.

Each peer runs B prompts of PP tokens and TG decode steps, greedy, and returns
the prefill time (until every sequence has its first token) and the decode
time (TG more tokens each), exactly what pagellm's batched bench measures.

- HF transformers `generate`: the model class of the checkpoint's architecture,
  given pagellm's loaded weights (so a GGUF needs no `from_pretrained(gguf_file=)`),
  batched with left padding, sdpa attention, the same dtype and torch threads.
  Where pagellm keeps its weights quantized (a GGUF as stored, int8, int4), HF gets
  the same file dequantized, loaded as `bench accuracy` loads its dense reference.
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

        self.model = model if model is not None else self._on_dense_weights(engine)
        self.pad_token_id = 0
        self.device = engine.device
        self.generate_options = {"cache_implementation": "static"} if static else {}
        self.name = "hf-static" if static else type(self).name
        dtype = str(engine.dtype).removeprefix("torch.")
        cache = "static cache (compiled by transformers)" if static else "dynamic cache"
        weights = ", on the file's weights dequantized" if engine.quantization else ""
        self.description = f"transformers {transformers.__version__} generate, sdpa, {cache}, {dtype}{weights}"

    @staticmethod
    def _on_dense_weights(engine):
        from transformers import AutoModelForCausalLM

        weights = dense_model(engine)
        with torch.device(engine.device):  # its init and buffers on the device (on the CPU: slow, and copied)
            model = AutoModelForCausalLM.from_config(transformers_config(engine.hf_config), dtype=engine.dtype,
                                                     attn_implementation="sdpa")
        # assign=True: HF's parameters become pagellm's tensors, so the weights are not held twice.
        missing, unexpected = model.load_state_dict(checkpoint_state_dict(weights), strict=False, assign=True)
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


def why_no_dense_weights(engine) -> str | None:
    """Why HF cannot run on the engine's weights, or None: quantized random weights have no file to dequantize."""
    if engine.quantization and engine.config.model.load_format == "dummy":
        return "pagellm runs random quantized weights (--load-format dummy): there is no file to dequantize"
    return None


def dense_model(engine) -> torch.nn.Module:
    """The model whose weights HF is given: the engine's own when they are dense, else the same file dequantized
    in the engine's dtype, loaded by the code that loads `bench accuracy`'s dense reference."""
    if not engine.quantization:
        return engine.model
    reason = why_no_dense_weights(engine)
    if reason is not None:
        raise ValueError(f"HF peer: {reason}")
    from pagellm.eval.forward import load_mode

    return load_mode(engine.model_path, "none", engine.dtype, engine.config.kernels).to(engine.device)


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
