"""The CUDA plan (models/bound_layers.py with the Triton kernel set) against the modules, on a CPU.

Without CUDA the Triton kernels run under Triton's interpreter (tests/gpu/__init__.py) on CPU tensors: what is
proved is the plan's logic on the GPU's kernels (the residual stream handed on, norms' kernel weights made once,
q/k/v preparation writing the cache, GQA attention through the block table, act * up), for the families'
variants: plain Llama, Qwen3's q/k norms, Gemma 3's unit-offset sandwich norms, sliding window and gelu(tanh).
fp32, so it matches the modules to the kernels' summation order; bf16 is the device check's.
"""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.ops import REFERENCE, triton_ops
from pagellm.layers.kernel_user import KernelUser, bind_kernel_level
from pagellm.loader.model_loader import load_model
from pagellm.models.bound_layers import PlanSettings, plan_model, triton_step_kernels
from tests.gpu import DEVICE, ON_GPU, interpreter
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")


def _triton_kernels():
    with interpreter(not ON_GPU):  # the kernel modules are decorated under the interpreter when first imported
        return triton_step_kernels()


@pytest.mark.parametrize("family", ["llama", "qwen3-yarn", "gemma3"])
def test_the_triton_plan_equals_the_modules(tmp_path, family):
    write_tiny_checkpoint(family, tmp_path)
    reference, model = (load_model(str(tmp_path), torch.float32, torch.device(DEVICE), False, "none").model
                        for _ in range(2))  # each harness binds its own caches to its model's layers
    plan = plan_model(model, PlanSettings(None, torch.float32, torch.float32), kernels=_triton_kernels())
    assert plan.description == f"bound to the Triton kernels ({len(model.model.layers)} layers)"
    modules, bound = PagedHarness(reference, bound_layers=False), PagedHarness(model, bound_layers=False)
    bound.plan = plan  # the Triton set on this device's tensors
    prompt = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    for feed in (prompt[:9], prompt[9:], [7], [9]):  # a prefill in two chunks, then two decodes
        torch.testing.assert_close(bound.step({"a": feed})["a"], modules.step({"a": feed})["a"], atol=1e-4,
                                   rtol=1e-4)


def test_the_triton_set_takes_what_the_gpu_kernels_take():
    """Any float activations and K/V pair and any even head size (the CPU set: fp32 / bf16 pairs, multiples of
    16)."""
    kernels = _triton_kernels()
    assert kernels.pairs(torch.float16, torch.float16) and kernels.pairs(torch.bfloat16, torch.float32)
    assert kernels.head_dim_ok(80) and kernels.head_dim_ok(72) and not kernels.head_dim_ok(81)


def test_the_device_family_check_runs_here(capsys):
    """tests/gpu/device_families.py, the GPU run's family check, rehearsed on the CPU with one family."""
    from tests.gpu.device_families import check

    assert check("llama", "cpu")
    assert "llama | float32: 3/3 identical" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3.5", "qwen3-next"])
def test_moe_and_hybrid_models_are_bound_to_the_triton_set_and_equal_their_modules(tmp_path, family):
    """A MoE block and a Gated DeltaNet mixer run as their modules' own steps inside the bound plan, as on CPUs:
    a prefill in two chunks then decodes equal the modules' (the mixer's decode on the Triton kernels both ways,
    its slots read and written in place)."""
    write_hybrid_checkpoint(family, tmp_path)
    reference, model = (load_model(str(tmp_path), torch.float32, torch.device(DEVICE), False, "none").model
                        for _ in range(2))
    modules, bound = PagedHarness(reference, bound_layers=False), PagedHarness(model, bound_layers=False)
    ops = _triton_ops()  # bound into every module by the plan (after the harnesses planned theirs)
    bound.plan = plan_model(model, PlanSettings(None, torch.float32, torch.float32, ops=ops), kernels=_triton_kernels())
    assert bound.plan.bound is not None and bound.plan.description.startswith("bound to the Triton kernels")
    bind_kernel_level(reference, None, ops)
    assert model.model.norm.ops is ops
    prompt = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    for feed in (prompt[:9], prompt[9:], [7], [9]):
        torch.testing.assert_close(bound.step({"a": feed})["a"], modules.step({"a": feed})["a"], atol=1e-4,
                                   rtol=1e-4)


def test_the_cuda_backend_binds_the_triton_ops_into_every_module(tmp_path):
    """CudaBackend.layer_ops is the Triton table: the modules' norms, q/k/v preparation, act * up and attention
    are the kernels of kernels/gpu/, bound by the plan (no device test at a call)."""
    from pagellm.kernels.gpu import attention, layer_ops
    from pagellm.runner.backend import CudaBackend

    with interpreter(not ON_GPU):
        ops = CudaBackend.ops_at(None, torch.bfloat16)
    assert (ops.add_rms_norm, ops.rms_norm, ops.act_mul, ops.qkv_prepare, ops.attention) == (
        layer_ops.add_rms_norm, layer_ops.rms_norm, layer_ops.act_mul, layer_ops.qkv_prepare,
        attention.paged_attention_triton)
    assert ops.attention_for(72, torch.bfloat16, torch.float16) is attention.paged_attention_triton
    write_tiny_checkpoint("llama", tmp_path)
    model = load_model(str(tmp_path), torch.float32, torch.device(DEVICE), False, "none").model
    plan_model(model, PlanSettings(None, torch.float32, torch.float32, ops=ops), kernels=_triton_kernels())
    assert {id(m.ops) for m in model.modules() if isinstance(m, KernelUser)} == {id(ops)}


@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe", "qwen3-next"])
def test_the_modules_on_the_triton_ops_equal_the_torch_reference(tmp_path, family):
    """What MoE and hybrid models run on CUDA today (their modules), on the Triton table, against the same
    modules on torch's reference ops: norms, partial rotary, gated attention, the experts' act * up, the
    Gated DeltaNet's decode (Triton's conv update and delta rule against torch's; its prefill torch on both), a
    prefill in two chunks then decodes."""
    (write_hybrid_checkpoint if family.startswith("qwen3-") else write_tiny_checkpoint)(family, tmp_path)
    reference, model = (load_model(str(tmp_path), torch.float32, torch.device(DEVICE), False, "none").model
                        for _ in range(2))
    harnesses = PagedHarness(reference, bound_layers=False), PagedHarness(model, bound_layers=False)
    bind_kernel_level(reference, None, REFERENCE)
    bind_kernel_level(model, None, _triton_ops())
    assert model.model.norm.ops.gated_delta_decode.rule_.__module__ == "pagellm.kernels.gpu.gated_delta"
    prompt = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    for feed in (prompt[:9], prompt[9:], [7], [9]):
        want, got = (harness.step({"a": feed})["a"] for harness in harnesses)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _triton_ops():
    with interpreter(not ON_GPU):
        return triton_ops()
