"""`load_format="dummy"` (vLLM's `--load-format dummy`): a model from its config.json alone, random weights."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.cli import build_parser, engine_config_from_args
from pagellm.config import ModelConfig
from pagellm.loader.dummy import DUMMY_RANGE
from pagellm.loader.model_loader import load_model
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import HYBRID_CONFIGS, TINY_CONFIGS, write_char_tokenizer, write_tiny_checkpoint

FAMILIES = {**TINY_CONFIGS, **HYBRID_CONFIGS}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_from_its_config_alone(family, tmp_path):
    """No weights, no tokenizer: each parameter drawn in the dummy range under its checkpoint name, and a
    forward over the paged cache gives finite logits."""
    FAMILIES[family]().save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"), load_format="dummy")
    assert loaded.tokenizer is None
    parameters = list(loaded.model.parameters())
    assert parameters and all(p.abs().max() <= DUMMY_RANGE for p in parameters)
    assert all(p.std() > DUMMY_RANGE / 4 for p in parameters if p.numel() > 64)  # drawn, not left at zero
    logits = PagedHarness(loaded.model).prefill("a", list(range(3, 12)))
    assert torch.isfinite(logits).all()


def test_the_same_config_gives_the_same_model_and_ignores_the_files_weights(tmp_path):
    hf_model = write_tiny_checkpoint("llama", tmp_path)
    first, second = (load_model(str(tmp_path), torch.float32, torch.device("cpu"), with_tokenizer=False,
                                load_format="dummy").model for _ in range(2))
    embedding = "model.embed_tokens.weight"
    assert torch.equal(first.state_dict()[embedding], second.state_dict()[embedding])  # one seeded generator
    assert not torch.equal(first.state_dict()[embedding], hf_model.state_dict()[embedding])


def test_llm_generates_from_token_ids_and_loads_a_tokenizer_where_there_is_one(tmp_path):
    TINY_CONFIGS["llama"]().save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tmp_path), load_format="dummy", kv_cache_memory=0.01, max_model_len=64)
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 4
    with pytest.raises(ValueError, match="prompt must be token ids"):
        llm.generate("text", params, use_tqdm=False)
    write_char_tokenizer(tmp_path)
    with_tokenizer = LLM(model=str(tmp_path), load_format="dummy", kv_cache_memory=0.01, max_model_len=64)
    assert with_tokenizer.tokenizer is not None
    assert with_tokenizer.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids == out


def test_a_load_format_is_named_and_checked():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy, got 'safetensors'"):
        ModelConfig(load_format="safetensors")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--load-format", "dummy"])
    assert engine_config_from_args(args).model.load_format == "dummy"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_random_weights_can_be_quantized_as_they_load(quantization, tmp_path):
    """The names are taken before quantized loading swaps its placeholders in (a lazy walk lost those weights)."""
    TINY_CONFIGS["llama"]().save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"), with_tokenizer=False,
                        quantization=quantization, load_format="dummy")
    assert loaded.quantization and set(loaded.quantization.values()) == {quantization}
    assert torch.isfinite(PagedHarness(loaded.model).prefill("a", list(range(3, 12)))).all()
