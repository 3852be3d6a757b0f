"""The module path runs the kernels its plan bound, never the torch reference in their place: at this process's
level (tests/lower_levels.py repeats it at the others) every call of a family's step goes to the kernel, whatever
the layout of its input (the halves of Qwen3-Next's gated q projection, the rotated part of a partial rotary are
views). A wrapper declines only for what planning knows (no kernel at the level, a dtype it does not take)."""

from __future__ import annotations

import collections

import pytest
import torch

import pagellm.layers.mlp as mlp
import pagellm.layers.norm as norm
import pagellm.layers.rotary as rotary
import pagellm.models.llama as llama
from pagellm.kernels import attention, native
from pagellm.loader.model_loader import load_model
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

WRAPPERS = [(norm, "rms_norm"), (norm, "add_rms_norm"), (rotary, "rotary"), (mlp, "act_mul"),
            (llama, "qkv_prepare"), (llama, "logits_to_f32")]


def counted_wrappers(monkeypatch) -> collections.Counter:
    """Every wrapper of WRAPPERS counted: {(name, "kernel" | "declined"): calls}."""
    calls = collections.Counter()

    def counted(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            calls[name, "declined" if out is None else "kernel"] += 1
            return out
        monkeypatch.setattr(module, name, call)
    for module, name in WRAPPERS:
        counted(module, name)
    return calls


@pytest.mark.skipif(native.default_level() is None, reason="native kernels are off in this run: nothing to bind")
@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe", "qwen3-next"])
def test_every_module_kernel_call_runs_the_kernel(tmp_path, monkeypatch, family):
    (write_hybrid_checkpoint if family.startswith("qwen3-") else write_tiny_checkpoint)(family, tmp_path)
    dtype = torch.bfloat16 if native.default_level() == "avx512" else torch.float32  # the level's auto dtype
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), with_tokenizer=False).model
    calls = counted_wrappers(monkeypatch)
    monkeypatch.setattr(attention, "paged_attention_reference", lambda *args, **kwargs: calls.update(
        [("paged_attention", "declined")]) or pytest.fail("the attention's torch reference ran"))
    harness = PagedHarness(model, bound_layers=False)  # the modules, bound to this process's level
    harness.prefill("a", list(range(3, 14)))
    harness.step({"a": [5]})
    assert not [key for key in calls if key[1] == "declined"], dict(calls)
    assert calls["rms_norm", "kernel"] and calls["act_mul", "kernel"] and calls["logits_to_f32", "kernel"]


@pytest.mark.skipif(native.default_level() is None, reason="native kernels are off in this run: nothing to bind")
@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next", "qwen3.5-moe"])
def test_a_planned_step_runs_kernels_only(tmp_path, monkeypatch, family):
    """MoE and hybrid families through their plan: the bound parts call the kernels directly; what runs as its
    module's step (a MoE block, a Gated DeltaNet or gated attention mixer) calls wrappers that never decline to
    the torch reference."""
    write_hybrid_checkpoint(family, tmp_path)
    dtype = torch.bfloat16 if native.default_level() == "avx512" else torch.float32
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), with_tokenizer=False).model
    calls = counted_wrappers(monkeypatch)
    monkeypatch.setattr(attention, "paged_attention_reference",
                        lambda *args, **kwargs: pytest.fail("the attention's torch reference ran"))
    harness = PagedHarness(model)  # planned as the runner plans
    assert harness.plan.bound is not None, harness.plan.description
    harness.prefill("a", list(range(3, 40)))
    harness.step({"a": [5]})
    assert calls["act_mul", "kernel"] > 0 and not [key for key in calls if key[1] == "declined"], dict(calls)
