"""GGUF loading of Qwen3-MoE, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE against the same model loaded from HF.

Each case is a tiny random HF checkpoint converted in the test (gguf_hybrid_builders.convert_to_gguf, llama.cpp's
transforms as we read them) and loaded back through pagellm: config, every weight, logits and greedy tokens must
match the HF-loaded model (itself checked against transformers in tests/models/test_hybrid_parity.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagellm.layers.gguf_linear import GGUFLinear
from pagellm.layers.gguf_moe import GGUFMoeExperts
from pagellm.loader.gguf import iter_gguf_weights, load_gguf_config, read_gguf_header
from pagellm.loader.gguf_hybrid import OUT_PROJ_TILED, grouped_from_tiled
from pagellm.loader.model_loader import load_model
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.models.registry import build_model
from tests.loader.gguf_hybrid_builders import (CASES, Conversion, convert_to_gguf, write_hf_checkpoint,
                                               write_k_quant_moe_gguf)
from tests.models.paged_harness import PagedHarness, greedy_generate

# (w + 1) - 1 and log(-(-exp(x))) in float32 are within an ulp or two of w; everything else is bit-exact
ROUNDED = ("norm.weight", "A_log")
LOGITS_TOL = dict(atol=1e-5, rtol=1e-5)


@dataclass
class Converted:
    hf_dir: Path
    gguf: Path
    stored: dict[str, np.ndarray]  # GGUF name -> values as stored


def convert(directory: Path, family: str, conversion: Conversion) -> Converted:
    write_hf_checkpoint(family, directory / "hf")
    stored = convert_to_gguf(directory / "hf", directory / "model.gguf", conversion)
    return Converted(directory / "hf", directory / "model.gguf", stored)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Converted:
    family, conversion = CASES[request.param]
    return convert(tmp_path_factory.mktemp(request.param), family, conversion)


def load_pair(case: Converted):
    """(model from the GGUF, model from the HF checkpoint), float32."""
    config = load_gguf_config(case.gguf)
    from_gguf = build_model(config, torch.float32)
    from_gguf.load_weights(iter_gguf_weights(case.gguf, config, progress=False))
    from_hf = build_model(load_hf_config(case.hf_dir), torch.float32)
    from_hf.load_weights(iter_safetensors_weights(case.hf_dir, progress=False))
    return from_gguf, from_hf


def test_config_matches_the_hf_config(case):
    ours, hf = load_gguf_config(case.gguf), load_hf_config(case.hf_dir)
    assert type(ours) is type(hf) and ours.architectures == hf.architectures
    fields = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "hidden_act",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "layer_types", "linear_conv_kernel_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"]
    for field in fields:
        if hasattr(hf, field):
            assert getattr(ours, field) == getattr(hf, field), field
    for key in ("rope_theta", "partial_rotary_factor"):
        assert ours.rope_parameters.get(key) == hf.rope_parameters.get(key), key
    if hasattr(hf, "intermediate_size"):  # the dense MLP size: Qwen3.5-MoE's config has none
        assert ours.intermediate_size == hf.intermediate_size


def test_every_weight_comes_back_as_the_checkpoint_holds_it(case):
    """Per-expert names included (the model stacks them), MTP layers left out. A Qwen3.5 DeltaNet's out_proj with
    more value heads than key heads keeps the file's column order (its layer takes its inputs in that order):
    its columns in HF's order are the stored ones picked by grouped_from_tiled."""
    config = load_gguf_config(case.gguf)
    ours = dict(iter_gguf_weights(case.gguf, config, progress=False))
    theirs = dict(iter_safetensors_weights(case.hf_dir, progress=False))
    assert sorted(ours) == sorted(theirs)
    if getattr(config, OUT_PROJ_TILED, False):
        columns = grouped_from_tiled(config.linear_num_key_heads,
                                     config.linear_num_value_heads // config.linear_num_key_heads,
                                     config.linear_value_head_dim)
        for name in [n for n in ours if n.endswith("linear_attn.out_proj.weight")]:
            assert not torch.equal(ours[name], theirs[name]), name  # the file's order, not HF's
            ours[name] = ours[name][:, columns]
    for name, expected in theirs.items():
        assert ours[name].dtype == torch.float32, name
        if name.endswith(ROUNDED):
            torch.testing.assert_close(ours[name], expected, atol=2e-7, rtol=1e-6, msg=name)
        else:
            assert torch.equal(ours[name], expected), name


def test_logits_and_greedy_tokens_match_the_hf_loaded_model(case):
    from_gguf, from_hf = load_pair(case)
    prompt = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.testing.assert_close(PagedHarness(from_gguf).prefill("a", prompt), PagedHarness(from_hf).prefill("a", prompt),
                               **LOGITS_TOL)
    assert greedy_generate(from_gguf, prompt, max_new_tokens=16) == greedy_generate(from_hf, prompt, max_new_tokens=16)


def test_the_converter_moved_what_the_loader_must_move_back(case):
    """Guards the fixture: if it stored these tensors in HF layout, the tests above would prove nothing."""
    theirs = dict(iter_safetensors_weights(case.hf_dir, progress=False))
    stored = case.stored
    hf_layout = {"blk.0.attn_norm.weight": theirs["model.layers.0.input_layernorm.weight"]}
    if "blk.0.attn_gate.weight" in stored and "model.layers.0.linear_attn.in_proj_z.weight" in theirs:
        hf_layout["blk.0.attn_gate.weight"] = theirs["model.layers.0.linear_attn.in_proj_z.weight"]  # tiled
    if "blk.0.attn_qkv.weight" in stored and "model.layers.0.linear_attn.in_proj_qkvz.weight" in theirs:
        hf_layout["blk.0.attn_qkv.weight"] = theirs["model.layers.0.linear_attn.in_proj_qkvz.weight"][:128]  # split
    if "blk.0.ssm_a" in stored:
        hf_layout["blk.0.ssm_a"] = theirs["model.layers.0.linear_attn.A_log"]
    moved = {name: not np.array_equal(stored[name], w.numpy()) for name, w in hf_layout.items()}
    hybrid = "blk.0.ssm_a" in stored
    assert moved == {name: hybrid for name in hf_layout}  # Qwen3-MoE norms are stored as they are


@pytest.mark.parametrize("family,key", [("qwen3-next", "qwen3next.ssm.state_size"),
                                        ("qwen3-moe", "qwen3moe.expert_feed_forward_length"),
                                        ("qwen3.5-moe", "qwen35moe.expert_shared_feed_forward_length")])
def test_missing_required_metadata_is_named(tmp_path, family, key):
    converted = convert(tmp_path, family, Conversion(drop_metadata=(key,)))
    with pytest.raises(ValueError, match=rf"model\.gguf.*metadata key {key} is missing"):
        load_gguf_config(converted.gguf)


def test_unknown_tensor_is_named_before_anything_is_read(tmp_path):
    extra = {"blk.0.ssm_mystery.weight": np.zeros(4, dtype=np.float32)}
    converted = convert(tmp_path, "qwen3.5", Conversion(extra_tensors=extra))
    with pytest.raises(ValueError, match=r"blk\.0\.ssm_mystery\.weight"):
        next(iter_gguf_weights(converted.gguf, load_gguf_config(converted.gguf), progress=False))


@pytest.mark.parametrize("family,layers", [("qwen3.5", ["in_proj_qkv", "in_proj_z"]),
                                            ("qwen3-next", ["in_proj_qkvz"])])
def test_auto_quantization_keeps_the_files_blocks_through_reorder_and_merge(tmp_path, family, layers):
    """attn_qkv / attn_gate stored Q4_0: Qwen3.5's in_proj_qkv and in_proj_z (value rows reordered) and Qwen3-Next's
    in_proj_qkvz (two tensors merged, rows interleaved) keep the stored blocks, rows moved whole; so does the
    Q8_0 ssm_out, Qwen3.5's too: its columns stay in the file's order, which its layer takes (OUT_PROJ_TILED).
    Each holds exactly the dense model's weights."""
    types = {"blk.0.attn_qkv.weight": T.Q4_0, "blk.0.attn_gate.weight": T.Q4_0, "blk.0.ssm_out.weight": T.Q8_0}
    converted = convert(tmp_path, family, Conversion(types=types))
    dense = load_model(str(converted.gguf), torch.float32, torch.device("cpu"), with_tokenizer=False)
    loaded = load_model(str(converted.gguf), torch.float32, torch.device("cpu"), with_tokenizer=False,
                        quantization="auto")
    names = [f"model.layers.0.linear_attn.{layer}" for layer in [*layers, "out_proj"]]
    assert loaded.quantization == dict.fromkeys(names, "gguf")
    for name in names:
        module = loaded.model.get_submodule(name)
        assert isinstance(module, GGUFLinear), name
        weight = module.dequantize()
        assert torch.equal(weight, dense.model.get_submodule(name).weight)


def test_moe_experts_stay_in_their_k_quant_blocks(tmp_path):
    """A Qwen3-MoE GGUF with Q4_K gate/up and Q6_K down experts: every expert stays in its blocks (resident
    weights about the file's size, not 4-8x), holds exactly the file's weights, and the model's logits stay
    within the activations' int8 rounding of the dense model of the same file."""
    path = write_k_quant_moe_gguf(tmp_path)
    dense = load_model(path, torch.float32, torch.device("cpu"), with_tokenizer=False)
    blocks = load_model(path, torch.float32, torch.device("cpu"), with_tokenizer=False, quantization="auto")
    experts = [f"model.layers.{i}.mlp.experts" for i in range(3)]
    assert all(blocks.quantization[p] == "gguf_experts" for p in experts)
    for p in experts:
        layer, reference = blocks.model.get_submodule(p), dense.model.get_submodule(p)
        gate_up, down = layer.dequantized()
        assert torch.equal(gate_up, reference.gate_up_proj) and torch.equal(down, reference.down_proj)
    file_bytes = sum(t.data.nbytes for t in read_gguf_header(path).tensors if t.name.endswith("_exps.weight"))
    expert_bytes = sum(b.numel() for p in experts for b in blocks.model.get_submodule(p).buffers())
    assert file_bytes <= expert_bytes <= 1.03 * file_bytes
    layer, reference = blocks.model.get_submodule(experts[0]), dense.model.get_submodule(experts[0])
    for tokens in (1, 24):  # one token per expert call, and tokens grouped by expert
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
        weights, ids = torch.rand(tokens, 2), torch.randint(0, 8, (tokens, 2)).sort(dim=1).values
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 8, ids[:, 1])
        expected = reference(x, weights, ids)
        assert ((layer(x, weights, ids) - expected).norm() / expected.norm()).item() < 0.02  # int8 activations
    prompt = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = PagedHarness(dense.model).prefill("a", prompt)
    got = PagedHarness(blocks.model).prefill("a", prompt)
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\nMoE GGUF as stored vs dense: top-1 agreement {agreement:.3f}", end="")
    assert agreement >= 0.75  # routing is discrete: a small error can pick other experts, downstream


@pytest.mark.parametrize("name", list(CASES))
def test_every_family_runs_with_its_blocks_as_stored(tmp_path, name):
    """Every 2-D weight and the experts stored Q8_0: the default load keeps them in blocks; on the dense model's
    own activations each block layer computes its output within the activations' int8 rounding, and the whole
    model runs. (Whole-model logits are no test here: a tiny random MoE model is chaotic, a 0.5% error in one
    layer flips routing and moves some tokens' logits by half their norm, dense weights or not.)"""
    family, conversion = CASES[name]
    write_hf_checkpoint(family, tmp_path / "hf")
    probe = convert_to_gguf(tmp_path / "hf", tmp_path / "probe.gguf", conversion)
    types = {n: T.Q8_0 for n, v in probe.items() if v.ndim >= 2 and v.shape[-1] % 32 == 0 and v.shape[-2] % 16 == 0}
    convert_to_gguf(tmp_path / "hf", tmp_path / "model.gguf", dataclasses.replace(conversion, types=types))
    path = str(tmp_path / "model.gguf")
    dense = load_model(path, torch.float32, torch.device("cpu"), with_tokenizer=False).model
    blocks = load_model(path, torch.float32, torch.device("cpu"), with_tokenizer=False, quantization="auto").model
    kept = {n: m for n, m in blocks.named_modules()  # token tables: lookups (exact), checked in test_quantized
            if isinstance(m, (GGUFLinear, GGUFMoeExperts)) and not n.endswith(".table")}
    assert any(isinstance(m, GGUFMoeExperts) for m in kept.values()) == ("moe" in name or "next" in name)
    seen = {}

    def keep_first_call(name):
        def hook(module, args, out) -> None:  # None: the output is left as it is
            seen.setdefault(name, (args, out))
        return hook

    hooks = [dense.get_submodule(n).register_forward_hook(keep_first_call(n)) for n in kept]
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    PagedHarness(dense).prefill("a", prompt)
    for hook in hooks:
        hook.remove()
    assert set(seen) == set(kept)
    for n, (args, expected) in seen.items():
        assert ((kept[n](*args) - expected).norm() / expected.norm()).item() < 0.03, n
    assert torch.isfinite(PagedHarness(blocks).prefill("a", prompt)).all()


def test_experts_without_a_block_kernel_are_dequantized_with_a_warning(tmp_path):
    types = {f"blk.{i}.ffn_down_exps.weight": T.Q3_K for i in range(3)}
    write_hf_checkpoint("qwen3-moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=256,
                        intermediate_size=256)
    convert_to_gguf(tmp_path / "hf", tmp_path / "model.gguf", Conversion(types=types))
    with pytest.warns(RuntimeWarning, match="Q3_K tensor"):
        loaded = load_model(str(tmp_path / "model.gguf"), torch.float32, torch.device("cpu"), False, "auto")
    assert not any(scheme == "gguf_experts" for scheme in loaded.quantization.values())


def test_a_tensor_parallel_shard_takes_out_proj_in_hf_order(tmp_path):
    """A shard splits out_proj's columns in HF's order (value heads grouped by key head), so a shard of a Qwen3.5
    GGUF gets them moved back at load and its layer does not move its output: rank 1's out_proj is the HF
    weight's second half of columns."""
    from pagellm.distributed.sharding import ShardSpec

    converted = convert(tmp_path, "qwen3.5", Conversion())
    config = load_gguf_config(converted.gguf)
    assert getattr(config, OUT_PROJ_TILED) and config.linear_num_value_heads > config.linear_num_key_heads
    shard = load_model(str(converted.gguf), torch.float32, torch.device("cpu"), with_tokenizer=False,
                       shard=ShardSpec(1, 2)).model
    layer = shard.get_submodule("model.layers.0.linear_attn")
    assert not layer.out_tiled
    hf = dict(iter_safetensors_weights(converted.hf_dir, progress=False))["model.layers.0.linear_attn.out_proj.weight"]
    assert torch.equal(layer.out_proj.weight, hf[:, hf.shape[1] // 2:])
