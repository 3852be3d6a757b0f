"""The module path runs the kernels its plan bound, never the torch reference in their place: at this process's
level (tests/lower_levels.py repeats it at the others) every layer op of a family's step is the kernel, whatever
the layout of its input (the halves of Qwen3-Next's gated q projection, the rotated part of a partial rotary are
views). The table of ops (kernels/ops.py) picks the reference only for what planning knows (no kernel at the
level, a dtype it does not take), and a kernel given what it does not take raises rather than declining."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from pagellm.kernels.build import native
from pagellm.kernels.reference import attention as reference_attention
from pagellm.kernels.reference import layer_ops as reference
from pagellm.layers.kernel_user import KernelUser, bind_kernel_level
from pagellm.loader.model_loader import load_model
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

OPS = ("rms_norm", "add_rms_norm", "rotary", "act_mul", "attention", "qkv_prepare", "logits_to_f32")


def counted_ops(model, monkeypatch) -> collections.Counter:
    """Rebinds `model`'s modules to a copy of their table whose every op counts its calls ({(op, "kernel"): n});
    the torch references a layer could be bound to instead fail the test."""
    calls = collections.Counter()
    ops = next(m.ops for m in model.modules() if isinstance(m, KernelUser))
    for name in ("rms_norm", "add_rms_norm", "rotary", "act_mul", "logits_to_f32"):
        monkeypatch.setattr(reference, name, lambda *a, name=name, **k: pytest.fail(f"torch's {name} ran"))
    monkeypatch.setattr(reference_attention, "paged_attention_reference",
                        lambda *a, **k: pytest.fail("the attention's torch reference ran"))

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name, "kernel"] += 1
            return fn(*args, **kwargs)
        return call
    assert all(getattr(ops, name) is not None for name in OPS), ops  # every op has its kernel at this level
    table = dataclasses.replace(ops, **{name: counted(name, getattr(ops, name)) for name in OPS})
    bind_kernel_level(model, native.default_level(), table)
    return calls


@pytest.mark.skipif(native.default_level() is None, reason="native kernels are off in this run: nothing to bind")
@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe", "qwen3-next"])
def test_every_module_kernel_call_runs_the_kernel(tmp_path, monkeypatch, family):
    (write_hybrid_checkpoint if family.startswith("qwen3-") else write_tiny_checkpoint)(family, tmp_path)
    dtype = torch.bfloat16 if native.default_level() == "avx512" else torch.float32  # the level's auto dtype
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), with_tokenizer=False).model
    harness = PagedHarness(model, bound_layers=False)  # the modules, bound to this process's level
    calls = counted_ops(model, monkeypatch)
    harness.prefill("a", list(range(3, 14)))
    harness.step({"a": [5]})
    assert calls["rms_norm", "kernel"] and calls["act_mul", "kernel"] and calls["logits_to_f32", "kernel"]
    assert calls["attention", "kernel"] and (calls["rotary", "kernel"] or calls["qkv_prepare", "kernel"]), calls
    if family == "qwen3-next":
        assert harness.model.model.layers[0].linear_attn.ops.gated_delta_decode is not None


@pytest.mark.skipif(native.default_level() is None, reason="native kernels are off in this run: nothing to bind")
@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next", "qwen3.5-moe"])
def test_a_planned_step_runs_kernels_only(tmp_path, monkeypatch, family):
    """MoE and hybrid families through their plan: the bound parts call the kernels directly; what runs as its
    module's step (a MoE block, a Gated DeltaNet or gated attention mixer) calls its table's kernels."""
    write_hybrid_checkpoint(family, tmp_path)
    dtype = torch.bfloat16 if native.default_level() == "avx512" else torch.float32
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), with_tokenizer=False).model
    harness = PagedHarness(model)  # planned as the runner plans
    assert harness.plan.bound is not None, harness.plan.description
    calls = counted_ops(model, monkeypatch)
    harness.prefill("a", list(range(3, 40)))
    harness.step({"a": [5]})
    assert calls["act_mul", "kernel"] > 0, dict(calls)
