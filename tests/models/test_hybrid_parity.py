"""Qwen3-MoE, Qwen3-Next, Qwen3.5 (dense and MoE) against HF transformers, eager fp32.

Tiny random checkpoints go through the real loader (per-expert keys stacked at
load). Our side runs over a paged KV cache with shuffled blocks and, for the
hybrid models, recurrent state in shuffled, NaN-initialised slots (paged_harness).
"""

from __future__ import annotations

import pytest
import torch

from pagellm.loader.model_loader import join_projections
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.models.registry import build_model
from tests.models.hf_reference import hf_greedy, hf_logits, load_ours, random_tokens
from tests.models.paged_harness import PagedHarness, greedy_generate
from tests.models.tiny_checkpoints import HYBRID_CONFIGS, write_hybrid_checkpoint

TOL = dict(atol=1e-4, rtol=1e-4)
PROMPT_LEN = 30
NEW_TOKENS = 16


def _hf_and_ours(family: str, path):
    hf_model = write_hybrid_checkpoint(family, path)
    return hf_model, load_ours(path)


@pytest.fixture(scope="module", params=list(HYBRID_CONFIGS))
def hf_and_ours(request, tmp_path_factory):
    return _hf_and_ours(request.param, tmp_path_factory.mktemp(request.param))


def test_layers_exposed_to_the_runner(hf_and_ours):
    hf_model, model = hf_and_ours
    layer_types = getattr(hf_model.config, "layer_types", None) or ["full_attention"] * 3
    assert len(model.attention_layers()) == layer_types.count("full_attention")
    assert len(model.state_layers()) == layer_types.count("linear_attention")


def test_prompt_logits_match_hf(hf_and_ours):
    hf_model, model = hf_and_ours
    prompt = random_tokens(PROMPT_LEN, seed=0)
    torch.testing.assert_close(PagedHarness(model).prefill("a", prompt), hf_logits(hf_model, prompt), **TOL)


def test_greedy_continuation_matches_hf_generate(hf_and_ours):
    hf_model, model = hf_and_ours
    prompt = random_tokens(PROMPT_LEN, seed=1)
    expected = hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert len(expected) == NEW_TOKENS
    assert greedy_generate(model, prompt, max_new_tokens=NEW_TOKENS) == expected


def test_chunked_prefill_and_decode_match_one_forward(hf_and_ours):
    hf_model, model = hf_and_ours
    prompt = random_tokens(90, seed=2)
    whole = PagedHarness(model).prefill("a", prompt)
    torch.testing.assert_close(whole, hf_logits(hf_model, prompt), **TOL)
    torch.testing.assert_close(PagedHarness(model, seed=1).prefill("a", prompt, chunk_size=7), whole, **TOL)
    harness = PagedHarness(model, seed=2)  # 7 + 70 (> one 64-token chunk, continuing a state) + 13
    chunks = [harness.step({"a": part})["a"] for part in (prompt[:7], prompt[7:77], prompt[77:])]
    torch.testing.assert_close(torch.cat(chunks), whole, **TOL)
    harness = PagedHarness(model, seed=3)
    decoded = [harness.prefill("a", prompt[:12])] + [harness.step({"a": [t]})["a"] for t in prompt[12:40]]
    torch.testing.assert_close(torch.cat(decoded), whole[:40], **TOL)


def test_mixed_batch_matches_each_sequence_alone(hf_and_ours):
    _, model = hf_and_ours
    a, b, c = random_tokens(PROMPT_LEN, seed=3), random_tokens(17, seed=4), random_tokens(75, seed=5)
    alone = {name: PagedHarness(model).prefill(name, seq) for name, seq in (("a", a), ("b", b), ("c", c))}
    harness = PagedHarness(model, seed=5)
    steps = [
        {"a": a[:12], "b": b[:13]},  # two fresh prefills of different lengths
        {"a": a[12:13], "b": b[13:16], "c": c[:3]},  # a decode, a prefill continuation, a fresh request
        {"a": a[13:14], "b": b[16:17], "c": c[3:70]},  # decodes next to a > 64-token continuation
        {"c": c[70:71], "a": a[14:15]},  # pure decode, order differs from slot order
        {"a": a[15:], "c": c[71:]},
    ]
    outputs = [harness.step(step) for step in steps]
    for name in alone:
        got = torch.cat([out[name] for out in outputs if name in out])
        torch.testing.assert_close(got, alone[name], **TOL)


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5", "qwen3.5-moe"])  # Qwen3-MoE has no wrapper
def test_vision_language_wrapper_keys_load(family, tmp_path):
    """Weights saved from the multimodal wrapper: `model.language_model.` prefix, plus `mtp.*` and
    `model.visual.*` tensors that the text model ignores (as HF's CausalLM classes do)."""
    hf_model, model = _hf_and_ours(family, tmp_path / "orig")
    path = tmp_path / "ckpt"
    hf_model.save_pretrained(path)
    weights = [(name.replace("model.", "model.language_model.", 1), tensor)
               for name, tensor in iter_safetensors_weights(path)]
    weights += [("mtp.fc.weight", torch.zeros(2, 2)), ("model.visual.patch_embed.proj.weight", torch.zeros(3))]
    rebuilt = build_model(load_hf_config(path), torch.float32)
    rebuilt.load_weights(weights)
    join_projections(rebuilt)  # as load_ours did: joined matmuls may round differently from separate ones
    prompt = random_tokens(12, seed=6)
    torch.testing.assert_close(PagedHarness(rebuilt).prefill("a", prompt), PagedHarness(model).prefill("a", prompt),
                               atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next", "qwen3.5-moe"])  # the MoE families
def test_stacked_expert_keys_load(family, tmp_path):
    """A checkpoint holding HF 5.x's in-memory layout (experts.gate_up_proj / experts.down_proj) loads too."""
    hf_model, model = _hf_and_ours(family, tmp_path / "orig")
    stacked = {name: p.detach() for name, p in hf_model.state_dict().items() if ".experts." in name}
    assert any(name.endswith("experts.gate_up_proj") for name in stacked)
    hf_model.save_pretrained(tmp_path)
    weights = [(n, t) for n, t in iter_safetensors_weights(tmp_path) if ".experts." not in n] + list(stacked.items())
    rebuilt = build_model(load_hf_config(tmp_path), torch.float32)
    rebuilt.load_weights(weights)
    join_projections(rebuilt)  # as load_ours did: joined matmuls may round differently from separate ones
    prompt = random_tokens(12, seed=7)
    torch.testing.assert_close(PagedHarness(rebuilt).prefill("a", prompt), PagedHarness(model).prefill("a", prompt),
                               atol=0, rtol=0)
