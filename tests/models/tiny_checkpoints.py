"""Tiny random-weight HF checkpoints, one per model family, written with save_pretrained.

Each config is small enough to run in well under a second but keeps what makes
its family different: grouped-query attention everywhere, a sliding window (8)
shorter than the ~20-token test prompts, mixed sliding/full layers with their
own RoPE bases, scaled RoPE, qkv bias, q/k norms, tied and untied embeddings.
"""

from __future__ import annotations

import re

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          PreTrainedModel, Qwen2Config, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config,
                          Qwen3MoeConfig, Qwen3NextConfig)

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
               eos_token_id=None, pad_token_id=0)  # no EOS: greedy runs always produce every token


def _llama() -> LlamaConfig:
    return LlamaConfig(**_COMMON, num_hidden_layers=2, architectures=["LlamaForCausalLM"])


def _llama3_scaled_rope_tied() -> LlamaConfig:
    # original_max_position_embeddings=64 puts the head_dim=16 frequencies on both sides of the
    # llama3 wavelength band (16..64), so kept, divided, and interpolated frequencies all occur.
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64)
    return LlamaConfig(**_COMMON, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=True,
                       attention_bias=True, architectures=["LlamaForCausalLM"])


def _mistral() -> MistralConfig:
    return MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=8, architectures=["MistralForCausalLM"])


def _qwen2() -> Qwen2Config:
    # Layers >= max_window_layers slide: layer 0 full, layers 1-2 sliding.
    return Qwen2Config(**_COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                       max_window_layers=1, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])


def _qwen3_yarn() -> Qwen3Config:
    # head_dim 32 != hidden / heads (16), as in real Qwen3 checkpoints; YaRN as Qwen3 uses for long
    # contexts, with original_max_position_embeddings small enough that the ramp falls inside head_dim.
    rope = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=64)
    return Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32, rope_parameters=rope,
                       architectures=["Qwen3ForCausalLM"])


def _gemma3() -> Gemma3TextConfig:
    rope = {"sliding_attention": dict(rope_type="default", rope_theta=100.0),
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=5000.0)}
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return Gemma3TextConfig(**_COMMON, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24,
                            sliding_window=8, layer_types=layer_types, rope_parameters=rope,
                            final_logit_softcapping=0.5, architectures=["Gemma3ForCausalLM"])


TINY_CONFIGS: dict[str, Callable[[], object]] = {
    "llama": _llama,
    "llama3-rope-tied": _llama3_scaled_rope_tied,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3-yarn": _qwen3_yarn,
    "gemma3": _gemma3,
}


def _save_jittered(config, directory: Path, seed: int, jitter: Callable[[str, torch.Tensor], None],
                   **from_config) -> PreTrainedModel:
    """Build the HF model of `config` (fp32, eager), perturb each parameter in place, save, return it."""
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **from_config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            jitter(name, param)
    hf_model.save_pretrained(directory)
    return hf_model.eval()


def _jitter_dense(name: str, param: torch.Tensor) -> None:
    # HF initialises norms to 1 (Gemma: 0) and biases to 0; jitter every weight so a
    # norm weight or bias loaded into the wrong place (or not at all) changes the logits.
    # Larger q/k weights sharpen attention, so a RoPE or masking mistake shows clearly.
    scale = 0.1 if param.ndim == 1 else 0.15 if re.search(r"[qk]_proj\.weight", name) else 0.02
    param.add_(torch.randn_like(param) * scale)


def write_tiny_checkpoint(family: str, directory: Path, seed: int = 0, config=None,
                          redraw: bool = False) -> PreTrainedModel:
    """Build the family's tiny HF model (eager attention, fp32), save it to `directory`, return it.

    config: a variant of the family's config to use instead of TINY_CONFIGS[family]().
    redraw: weights drawn as write_hybrid_checkpoint draws them (matrices std 0.1): with the default
    jitter's near-uniform logits a greedy run soon repeats one token, whatever the positions.
    """
    config = config if config is not None else TINY_CONFIGS[family]()
    return _save_jittered(config, directory, seed, _jitter_hybrid if redraw else _jitter_dense)


# Hybrid / MoE families (tests/models/test_hybrid_parity.py). 8 experts, top-2; Gated
# DeltaNet with 2 key heads shared by 4 value heads (r = 2, so the per-group interleave of
# Qwen3-Next's fused projections matters); head_dim 32 with partial RoPE 0.25 (8 rotary dims).
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention"])
_HYBRID_COMMON = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}


def _qwen3_moe() -> Qwen3MoeConfig:
    # Layer 1 dense (mlp_only_layers); transformers' default norm_topk_prob=False (no renormalisation).
    return Qwen3MoeConfig(**_COMMON, **_MOE, num_hidden_layers=3, head_dim=32, mlp_only_layers=[1],
                          architectures=["Qwen3MoeForCausalLM"])


def _qwen3_next() -> Qwen3NextConfig:
    # Layer 2 dense (mlp_only_layers), layers 0-1 MoE with a shared expert, renormalised top-k.
    return Qwen3NextConfig(**_COMMON, **_MOE, **_LINEAR, num_hidden_layers=3, head_dim=32,
                           shared_expert_intermediate_size=48, mlp_only_layers=[2],
                           architectures=["Qwen3NextForCausalLM"])


def _qwen3_5() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**_COMMON, **_LINEAR, num_hidden_layers=3, head_dim=32, tie_word_embeddings=True,
                             architectures=["Qwen3_5ForCausalLM"])


def _qwen3_5_moe() -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(**_HYBRID_COMMON, **_MOE, **_LINEAR, num_hidden_layers=3, head_dim=32,
                                shared_expert_intermediate_size=48, architectures=["Qwen3_5MoeForCausalLM"])


HYBRID_CONFIGS: dict[str, Callable[[], object]] = {
    "qwen3-moe": _qwen3_moe,
    "qwen3-next": _qwen3_next,
    "qwen3.5": _qwen3_5,
    "qwen3.5-moe": _qwen3_5_moe,
}


def write_hybrid_checkpoint(family: str, directory: Path, seed: int = 0, config=None) -> PreTrainedModel:
    """Like write_tiny_checkpoint for HYBRID_CONFIGS, eager attention and eager (per-expert loop) MoE.

    Matrices are redrawn with std 0.1 (default init gives near-uniform logits, so greedy
    tokens would hinge on rounding); 1-d weights get N(0, 0.1) added to their init (ones
    or, for zero-centred norms, zeros). A_log / dt_bias keep HF's init: they set the decay
    rates, which HF draws over a realistic range (A in [0.01, 16]).
    """
    config = config if config is not None else HYBRID_CONFIGS[family]()  # a variant of the family's config
    return _save_jittered(config, directory, seed, _jitter_hybrid, experts_implementation="eager")


def _jitter_hybrid(name: str, param: torch.Tensor) -> None:
    if name.endswith(("A_log", "dt_bias")):
        return
    if param.ndim == 1:
        param.add_(torch.randn_like(param) * 0.1)
    else:
        param.normal_(0.0, 0.1)


def write_tiny_checkpoint_with_tokenizer(directory: Path, chat_template: str | None = None) -> Path:
    """A tiny Qwen3 with the embedded Gemma tokenizer (262k ids) saved beside it: for what needs text (structured
    output, chat templates, tool calls). Weights as write_tiny_checkpoint(redraw=True) draws them."""
    from transformers import Qwen3Config

    from pagellm.config import ModelConfig
    from pagellm.loader.default_model import default_model_path
    from pagellm.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path(), ModelConfig().cache_dir, native=False)  # written by transformers
    config = Qwen3Config(**{**_COMMON, "vocab_size": 262144, "eos_token_id": sorted(tokenizer.eos_token_ids),
                            "max_position_embeddings": 1024},
                         num_hidden_layers=2, head_dim=32, architectures=["Qwen3ForCausalLM"])
    write_tiny_checkpoint("qwen3-yarn", directory, config=config, redraw=True)
    save_hf_tokenizer(tokenizer, directory, chat_template)
    return directory


def save_hf_tokenizer(tokenizer, directory: Path, chat_template: str | None = None) -> None:
    """A pagellm Tokenizer in its `tokenizers` form (load_tokenizer(..., native=False)) written as an HF directory's
    tokenizer files, by transformers (as a model repo has them)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, **tokenizer.info.special_tokens)
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(directory)


def write_char_tokenizer(directory: Path) -> None:
    """One token per character (printable ASCII and newline), BOS first: ids stay under the tiny vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # <s> is id 1, the checkpoint's bos_token_id
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(directory)
