"""The safetensors loader, the registry, and load_weights' strictness (tiny Llama checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config, num_tensors
from pagellm.models.registry import SUPPORTED_ARCHITECTURES, build_model
from tests.models.tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_tiny_checkpoint("llama", path)
    return path


def built(path, dtype=torch.float32):
    return build_model(load_hf_config(path), dtype)


def checkpoint_weights(path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors_weights(path))


def test_missing_config_and_weights_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json.*" + tmp_path.name):
        load_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors.*" + tmp_path.name):
        next(iter_safetensors_weights(tmp_path))


def test_sharded_checkpoint_yields_every_tensor_once(llama_dir, tmp_path):
    hf_model = write_tiny_checkpoint("llama", tmp_path / "single")  # same seed as llama_dir
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = checkpoint_weights(tmp_path / "sharded")
    assert num_tensors(tmp_path / "sharded") == len(sharded) == len(index["weight_map"])
    single = checkpoint_weights(llama_dir)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)


def test_unknown_architecture_is_named_with_the_supported_list():
    config = LlamaConfig(architectures=["FancyForCausalLM"])
    with pytest.raises(ValueError, match="FancyForCausalLM.*Qwen3ForCausalLM"):
        build_model(config, torch.float32)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_rejected_at_build():
    config = LlamaConfig(architectures=["LlamaForCausalLM"], rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="dynamic"):
        build_model(config, torch.float32)


def test_build_is_meta_then_load_materialises_everything_in_the_dtype(llama_dir):
    model = built(llama_dir, torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())
    model.load_weights(iter_safetensors_weights(llama_dir))
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_missing_unexpected_and_misshapen_weights_are_named(llama_dir):
    weights = checkpoint_weights(llama_dir)
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        built(llama_dir).load_weights(missing.items())
    extra = dict(weights, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected.*model.layers.9.mlp.up_proj.weight"):
        built(llama_dir).load_weights(extra.items())
    misshapen = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"shape mismatch.*model.norm.weight.*\(3,\)"):
        built(llama_dir).load_weights(misshapen.items())
    # Keys HF recomputes rather than loads are skipped, not "unexpected".
    built(llama_dir).load_weights(dict(weights, **{"model.rotary_emb.inv_freq": torch.zeros(8)}).items())


def test_tied_embeddings_ignore_a_stored_lm_head(tmp_path):
    write_tiny_checkpoint("llama3-rope-tied", tmp_path)
    weights = checkpoint_weights(tmp_path)
    assert "lm_head.weight" not in weights  # save_pretrained drops the tied copy
    model = built(tmp_path)
    stray_head = torch.zeros_like(weights["model.embed_tokens.weight"])
    model.load_weights(dict(weights, **{"lm_head.weight": stray_head}).items())
    hidden = torch.randn(3, 64)
    expected = hidden @ weights["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_safetensors_from_another_writer_load(tmp_path, llama_dir):
    """Any *.safetensors file in the directory counts, whatever its name."""
    weights = checkpoint_weights(llama_dir)
    names = sorted(weights)
    save_file({n: weights[n].contiguous() for n in names[: len(names) // 2]}, str(tmp_path / "a.safetensors"))
    save_file({n: weights[n].contiguous() for n in names[len(names) // 2 :]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    model = built(tmp_path)
    model.load_weights(iter_safetensors_weights(tmp_path))
    assert num_tensors(tmp_path) == len(names)
