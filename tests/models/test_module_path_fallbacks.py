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


@pytest.mark.skipif(native.default_level() is None, reason="native kernels are off in this run: nothing to bind")
@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe", "qwen3-next"])
def test_every_module_kernel_call_runs_the_kernel(tmp_path, monkeypatch, family):
    (write_hybrid_checkpoint if family.startswith("qwen3-") else write_tiny_checkpoint)(family, tmp_path)
    dtype = torch.bfloat16 if native.default_level() == "avx512" else torch.float32  # the level's auto dtype
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), with_tokenizer=False).model
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
    monkeypatch.setattr(attention, "paged_attention_reference", lambda *args, **kwargs: calls.update(
        [("paged_attention", "declined")]) or pytest.fail("the attention's torch reference ran"))
    harness = PagedHarness(model, bound_layers=False)  # the modules, bound to this process's level
    harness.prefill("a", list(range(3, 14)))
    harness.step({"a": [5]})
    assert not [key for key in calls if key[1] == "declined"], dict(calls)
    assert calls["rms_norm", "kernel"] and calls["act_mul", "kernel"] and calls["logits_to_f32", "kernel"]


@pytest.mark.skipif(native.default_level() is None, reason="native kernels are off in this run: nothing to bind")
def test_a_planned_moe_step_runs_kernels_only(tmp_path, monkeypatch):
    """Qwen3-MoE through its plan: the bound layers call the kernels directly; each MoE block's experts call the
    fused activation, which never declines to the torch reference."""
    write_hybrid_checkpoint("qwen3-moe", tmp_path)
    dtype = torch.bfloat16 if native.default_level() == "avx512" else torch.float32
    model = load_model(str(tmp_path), dtype, torch.device("cpu"), with_tokenizer=False).model
    calls = collections.Counter()
    real = mlp.act_mul

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["declined" if out is None else "kernel"] += 1
        return out
    monkeypatch.setattr(mlp, "act_mul", counted)
    monkeypatch.setattr(attention, "paged_attention_reference",
                        lambda *args, **kwargs: pytest.fail("the attention's torch reference ran"))
    harness = PagedHarness(model)  # planned as the runner plans
    assert harness.plan.bound is not None
    harness.prefill("a", list(range(3, 40)))
    harness.step({"a": [5]})
    assert calls["kernel"] > 0 and not calls["declined"], dict(calls)
