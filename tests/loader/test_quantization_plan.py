"""Which layers quantization takes in MoE / hybrid models: never the routers; wrapped Qwen3.5 checkpoints alike."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagellm.kernels.build import native
from pagellm.loader.model_loader import load_model
from pagellm.loader.quantization import plan_quantization, quantize_model, router_paths
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.models.registry import build_model
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import write_hybrid_checkpoint


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next", "qwen3.5-moe"])
def test_moe_routers_stay_dense(tmp_path, family):
    """The tiny routers ([8, 64] and [1, 64]) fit the int8 kernel, so only the exclusion keeps them dense."""
    write_hybrid_checkpoint(family, tmp_path)
    model = build_model(load_hf_config(tmp_path), torch.float32)
    routers = router_paths(model)
    names = dict(model.named_modules())
    assert routers and all(isinstance(names[path], torch.nn.Linear) for path in routers)
    assert all(path.endswith((".mlp.gate", ".mlp.shared_expert_gate")) for path in routers)
    assert any(path.endswith("shared_expert_gate") for path in routers) == (family != "qwen3-moe")
    for scheme in ("int8", "int4"):
        plan = plan_quantization(model, scheme, native.default_level())
        assert not routers & set(plan), scheme
        assert "model.layers.0.mlp.shared_expert.gate_proj" in plan or family == "qwen3-moe"
        assert "model.layers.1.self_attn.o_proj" in plan  # everything else still is
    model.load_weights(iter_safetensors_weights(tmp_path, progress=False))
    quantize_model(model, "int8", native.default_level())
    assert all(type(model.get_submodule(path)) is torch.nn.Linear for path in routers)


def test_wrapped_qwen3_5_checkpoint_quantizes_like_the_plain_one(tmp_path):
    """Weights saved from the vision-language wrapper (`model.language_model.` prefix, `mtp.*`, `model.visual.*`):
    the quantizer matches their names after the model's renames, so every planned layer is found and quantized."""
    write_hybrid_checkpoint("qwen3.5", tmp_path / "plain")
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps(json.loads((tmp_path / "plain" / "config.json").read_text())))
    weights = {name.replace("model.", "model.language_model.", 1): tensor.contiguous()
               for name, tensor in iter_safetensors_weights(tmp_path / "plain", progress=False)}
    weights.update({"mtp.fc.weight": torch.zeros(2, 2), "model.visual.patch_embed.proj.weight": torch.zeros(3)})
    save_file(weights, str(wrapped / "model.safetensors"))
    plain, ours = (load_model(str(tmp_path / name), torch.float32, torch.device("cpu"), with_tokenizer=False,
                              quantization="int8") for name in ("plain", "wrapped"))
    assert ours.quantization == plain.quantization
    assert "model.layers.0.linear_attn.in_proj_qkv" in ours.quantization
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.testing.assert_close(PagedHarness(ours.model).prefill("a", prompt),
                               PagedHarness(plain.model).prefill("a", prompt), atol=0, rtol=0)
