"""Layers bound to their kernels (models/bound_layers.py) against the module path: bit-identical results."""

from __future__ import annotations

import pytest
import torch

from pagellm import SamplingParams
from pagellm.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig
from pagellm.engine import LLMEngine
from pagellm.loader.model_loader import load_model
from pagellm.layers.norm import RMSNorm
from pagellm.kernels.build import native
from pagellm.models.bound_layers import PlanSettings, PlannedBackbone, plan_model
from tests.loader.gguf_builders import T, write_tiny_gguf
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

FAMILIES = ["llama", "qwen2", "qwen3-yarn", "gemma3"]  # plain, q/k/v bias, q/k norm, Gemma's sandwich norms


def _prefill_both_ways(model, prompt, kv_cache_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = []
    for bound in (True, False):
        harness = PagedHarness(model, kv_cache_dtype=kv_cache_dtype, bound_layers=bound)  # planned as the runner
        assert (harness.plan.bound is not None) is bound  # the path under test does apply
        logits.append(harness.prefill("a", prompt))
    return logits[0], logits[1]


def _greedy_ids(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    return [list(outputs[i]) for i in ids]


# (compute dtype, KV cache dtype): the pairs the kernels take; fp32 over bf16 K/V is the default without AVX-512 BF16
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
               (torch.float32, torch.float16)]
PAIR_IDS = ["fp32", "bf16", "fp32-bf16kv", "fp32-fp16kv"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype,kv_cache_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_bound_layers_equal_the_modules(tmp_path, family, quantization, dtype, kv_cache_dtype):
    write_tiny_checkpoint(family, tmp_path)
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), False, quantization).model
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    bound, modules = _prefill_both_ways(model, prompt, kv_cache_dtype)
    assert torch.equal(bound, modules)


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype,kv_cache_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_a_moe_backbone_is_planned_and_equals_the_modules(tmp_path, quantization, dtype, kv_cache_dtype):
    """Qwen3-MoE: attention, norms and the dense layer bound, each MoE block's own step between them (its
    routing and grouped experts); bit-identical to the modules, the prefill long enough for the grouped path."""
    write_hybrid_checkpoint("qwen3-moe", tmp_path)
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), False, quantization).model
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    bound, modules = _prefill_both_ways(model, prompt, kv_cache_dtype)
    assert torch.equal(bound, modules)
    plan = PagedHarness(model, kv_cache_dtype=kv_cache_dtype).plan
    assert [layer.moe is not None for layer in plan.bound.layers] == [True, False, True]  # layer 1: mlp_only


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5", "qwen3.5-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_hybrid_backbone_is_planned_and_equals_the_modules(tmp_path, family, dtype):
    """Gated DeltaNet and gated attention layers, dense and MoE MLPs: the adds, norms and dense MLPs bound, the
    token mixers and MoE blocks their own steps; bit-identical to the modules over a prefill in two chunks and a
    decode (the recurrent state carried in its slot)."""
    write_hybrid_checkpoint(family, tmp_path)
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), False, "none").model
    prompt = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    results = []
    for bound in (True, False):
        harness = PagedHarness(model, bound_layers=bound)
        assert (harness.plan.bound is not None) is bound, harness.plan.description
        results.append([harness.step({"a": piece})["a"] for piece in (prompt[:15], prompt[15:], [9])])
    for bound_logits, module_logits in zip(*results):
        assert torch.equal(bound_logits, module_logits)


@pytest.mark.parametrize("dtype,kv_cache_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_bound_layers_equal_the_modules_on_gguf_blocks(tmp_path, dtype, kv_cache_dtype):
    """A Gemma 3 GGUF as Q4_K_M files mix formats: q/k Q5_0 with v Q8_0 (one joined layer of two formats)."""
    types = {**{f"blk.{i}.{name}.weight": kind for i in range(2) for name, kind in (
        ("attn_q", T.Q5_0), ("attn_k", T.Q5_0), ("attn_v", T.Q8_0), ("attn_output", T.Q4_0), ("ffn_gate", T.Q5_0),
        ("ffn_up", T.Q5_0), ("ffn_down", T.Q4_K))}, "token_embd.weight": T.Q8_0}
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "gemma3", types=types, tie_embeddings=True)
    model = load_model(str(tiny.path), dtype, torch.device("cpu"), False, "auto").model
    layers = PagedHarness(model, kv_cache_dtype=kv_cache_dtype, bound_layers=True).plan.bound.layers
    assert all(None not in (layer.fused_mlp, layer.o_add_norm, layer.mlp_add_norm) for layer in layers)  # fused
    prompt = torch.randint(0, 64, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    bound, modules = _prefill_both_ways(model, prompt, kv_cache_dtype)
    assert torch.equal(bound, modules)


def test_engine_greedy_ids_equal_with_and_without_bound_layers(tmp_path):
    write_tiny_checkpoint("gemma3", tmp_path)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ids = []
    for bound in (True, False):
        engine = LLMEngine(EngineConfig(ModelConfig(model=str(tmp_path), quantization="int4", dtype="bfloat16"),
                                        CacheConfig(kv_cache_memory=0.01), kernels=KernelConfig(bound_layers=bound)),
                           skip_tokenizer_init=True)
        assert (engine.runner.plan.bound is not None) is bound
        ids.append(_greedy_ids(engine, prompts, params))
    assert ids[0] == ids[1]


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "float16"), ("bfloat16", "float32")])
def test_a_kv_cache_the_kernels_do_not_pair_runs_the_modules(tmp_path, dtype, kv_cache_dtype):
    """Any kv_cache_dtype the config takes runs: one the kernels cannot pair with the activations plans the
    modules, says why, and gives the greedy ids of the same cache without bound layers."""
    write_tiny_checkpoint("llama", tmp_path)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = []
    for bound in (True, False):
        engine = LLMEngine(EngineConfig(ModelConfig(model=str(tmp_path), quantization="int4", dtype=dtype),
                                        CacheConfig(kv_cache_memory=0.01, kv_cache_dtype=kv_cache_dtype),
                                        kernels=KernelConfig(bound_layers=bound)), skip_tokenizer_init=True)
        assert engine.runner.plan.bound is None
        if bound:
            assert engine.stats()["layers"] == (f"modules: a torch.{kv_cache_dtype} KV cache under torch.{dtype} "
                                                "activations, which the kernels do not pair")
        ids.append(_greedy_ids(engine, prompts, params))
    assert ids[0] == ids[1]


def test_plan_says_why_layers_run_as_modules(tmp_path):
    """The plan is chosen once and says why it cannot bind: a batch-size-dependent linear, a forward hook it does
    not know (one tensor parallel installs comes with its all-reduce, and binds); planning again follows."""
    write_tiny_checkpoint("llama", tmp_path)
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"), False, "int4").model
    layers, fp32 = model.model.layers, torch.float32

    def plan(enabled=True, **kwargs):
        return plan_model(model, PlanSettings(level, fp32, fp32, enabled, **kwargs))

    level = native.default_level()
    assert plan().description == f"bound to the kernels at {level} ({len(layers)} layers)" and plan().bound is not None
    handle = layers[1].mlp.register_forward_hook(lambda module, args, out: out)
    assert plan().description == "modules: layer 1 has forward hooks" and plan().bound is None
    assert plan(all_reduce=lambda t: t).description.startswith("bound")
    handle.remove()
    handle = layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, out: out)  # inside a block
    assert plan().description == "modules: layer 0 has forward hooks"
    handle.remove()
    layers[0].self_attn.o_proj.dense_from_rows = 1  # dense tiles from one row: batch-size dependent
    assert plan().description.startswith("modules: layer 0 has a linear") and plan().bound is None
    assert plan(False).description == "modules: bound layers switched off (KernelConfig.bound_layers)"


def test_nothing_of_the_plan_stays_on_the_modules(tmp_path):
    """The plan (raw pointers into the model's tensors, the norms' fp32 weights) is the runner's: the modules
    keep none of it, so a deep copy planned on its own runs the same as the original."""
    import copy

    write_tiny_checkpoint("gemma3", tmp_path)
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"), False, "none").model
    backbone, norms = model.model, [m for m in model.modules() if isinstance(m, RMSNorm)]
    before = [set(m.__dict__) for m in (backbone, *norms)]
    harness = PagedHarness(model)
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = harness.prefill("a", prompt)
    assert harness.plan.bound is not None and isinstance(backbone, PlannedBackbone)
    assert [set(m.__dict__) for m in (backbone, *norms)] == before  # planning and running added nothing
    assert torch.equal(logits, PagedHarness(copy.deepcopy(model)).prefill("a", prompt))
