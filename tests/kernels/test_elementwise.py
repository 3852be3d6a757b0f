"""The fused C++ RMSNorm against the torch reference (pagellm/layers/norm.py)."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.cpu import elementwise as native_norm
from pagellm.kernels.build import native
from pagellm.kernels.ops import REFERENCE, native_ops
from pagellm.kernels.reference import layer_ops as reference
from pagellm.layers.kernel_user import bind_kernel_level
from pagellm.layers.norm import RMSNorm
from tests.kernels import requires_compiler

pytestmark = requires_compiler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 640), (7, 64), (3, 4, 256), (300, 640), (2, 24)])
def test_native_matches_reference(dtype, unit_offset, shape, cpu_isa):
    torch.manual_seed(0)
    layer = RMSNorm(shape[-1], 1e-6, unit_offset=unit_offset)
    bind_kernel_level(layer, cpu_isa)
    layer.weight.data = (torch.randn(shape[-1]) * 0.5 + (0 if unit_offset else 1)).to(dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.inference_mode():
        fast = layer(x)
        reference = layer.reference(x)
    assert fast.dtype == dtype and fast.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)
    else:  # one bf16 rounding step apart at most: the fp32 sums differ in order only
        torch.testing.assert_close(fast.float(), reference.float(), atol=0, rtol=2 ** -7)


@requires_compiler
def test_takes_any_layout_and_refuses_only_what_planning_knows(cpu_isa):
    """A view is copied contiguous and normed by the kernel (bit for bit what the contiguous input gives); a dtype
    the kernel does not take (fp16) is refused, and a plan binds the reference for it (or for no level)."""
    layer = RMSNorm(16, 1e-6)
    bind_kernel_level(layer, cpu_isa)
    x = torch.randn(4, 32)[:, ::2]  # not contiguous
    strided = native_norm.rms_norm(x, layer.weight, 1e-6, False, cpu_isa)
    assert torch.equal(strided, native_norm.rms_norm(x.contiguous(), layer.weight, 1e-6, False, cpu_isa))
    torch.testing.assert_close(layer(x), layer.reference(x))
    rope = torch.randn(3, 2, 16)[..., :8]  # the rotated part of a partial rotary: a view
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(native_norm.rotary(rope, cos, sin, cpu_isa), native_norm.rotary(rope.contiguous(), cos, sin,
                                                                                          cpu_isa))
    half = torch.randn(4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="rms_norm: x torch.float16"):
        native_norm.rms_norm(half, layer.weight.half(), 1e-6, False, cpu_isa)
    assert native_ops(cpu_isa, torch.float16).rms_norm is reference.rms_norm
    assert native_ops(None) is REFERENCE and native_ops(cpu_isa).rms_norm.func is native_norm.rms_norm


def test_refreshes_the_fp32_weight_copy_when_the_weight_is_replaced(cpu_isa):
    layer = RMSNorm(8, 1e-6, unit_offset=True)
    bind_kernel_level(layer, cpu_isa)
    layer.weight = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        before = layer(x)
        layer.weight = torch.nn.Parameter(torch.full((8,), 2.0), requires_grad=False)
        after = layer(x)
    torch.testing.assert_close(after, before * 3.0)  # (1 + 2) instead of (1 + 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 256), (9, 2, 64), (200, 8, 128)])
def test_native_rotary_matches_reference_exactly(dtype, shape, cpu_isa):
    torch.manual_seed(1)
    tokens, _, dim = shape
    x = (torch.randn(shape) * 2).to(dtype)
    angles = torch.rand(tokens, dim // 2) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # The same per-op rounding as torch: bit-identical results in fp32 and bf16.
    assert torch.equal(native_norm.rotary(x, cos, sin, cpu_isa), reference.rotary(x, cos, sin))


@pytest.mark.across_levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_levels_bit_identical(dtype, unit_offset):
    """Every instruction-set level sums the squares in one order: the norms agree to the bit."""
    torch.manual_seed(1)
    layer = RMSNorm(648, 1e-6, unit_offset=unit_offset)  # 648: a tail past the 16-lane body
    layer.weight.data = (torch.randn(648) * 0.5 + (0 if unit_offset else 1)).to(dtype)
    x = (torch.randn(37, 648) * 3).to(dtype)

    def norm_at(level):  # the module, bound to each level in turn
        bind_kernel_level(layer, level)
        return layer(x)

    with torch.inference_mode():
        outputs = native.each_level(norm_at)
    for level, out in outputs.items():
        assert torch.equal(out, outputs["generic"]), level
