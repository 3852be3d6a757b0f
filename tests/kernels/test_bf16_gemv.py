"""The dense bf16 matmul of a few rows (kernels/cpu/bf16_gemv.py) against a float64 reference, and the layer that
calls it (layers/dense.py) against torch's F.linear.

Reference: the bf16 inputs' exact products summed in float64. The kernel sums in fp32, so it may differ from it
by fp32 rounding (bounded relative to sum |x| |w|), plus one rounding for a bf16 output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.cpu import bf16_gemv
from pagellm.layers.dense import DenseLinear, use_dense_kernels
from pagellm.layers.kernel_user import bind_kernel_level
from tests.kernels import requires_compiler

pytestmark = [requires_compiler, pytest.mark.levels("avx512")]  # AVX-512 BF16 only: F.linear elsewhere


def _case(rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=g) * 0.05).bfloat16()
    bias = (torch.randn(rows, generator=g) * 0.1).bfloat16()
    x = torch.randn(9, cols, generator=g).bfloat16()
    return x, weight, bias


def _within_fp32_sums(out: torch.Tensor, x, weight, bias) -> None:
    exact = x.double() @ weight.double().t() + bias.double()
    bound = (x.double().abs() @ weight.double().abs().t() + bias.double().abs()) * 2.0**-20  # fp32 sums' rounding
    if out.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8  # one rounding to bf16
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows,cols", [(7, 31), (37, 999), (64, 64), (100, 2048)])
def test_products_of_one_to_nine_rows_are_the_exact_sums_in_fp32(cpu_isa, rows, cols):
    x, weight, bias = _case(rows, cols)
    for m in range(1, 10):  # passes of four activation rows, a tail of 1..3; tiles of six weight rows, a tail
        for out_dtype in (torch.float32, torch.bfloat16):
            out = bf16_gemv.matmul(x[:m], weight, bias, cpu_isa, out_dtype)
            assert out.shape == (m, rows) and out.dtype == out_dtype
            _within_fp32_sums(out, x[:m], weight, bias)
    assert torch.equal(bf16_gemv.matmul(x[:3], weight, None, cpu_isa, torch.float32),
                       bf16_gemv.matmul(x[:3], weight, torch.zeros_like(bias), cpu_isa, torch.float32))


def test_a_row_is_the_same_bits_at_any_place_in_any_batch(cpu_isa):
    """A verify step's rows equal its decode steps': each row's sums do not depend on the others."""
    x, weight, bias = _case(203, 640, seed=1)  # enough for both threads
    alone = [bf16_gemv.matmul(x[i:i + 1], weight, bias, cpu_isa) for i in range(9)]
    for start in range(4):
        for m in range(1, 6):
            batch = bf16_gemv.matmul(x[start:start + m], weight, bias, cpu_isa)
            for i in range(m):
                assert torch.equal(batch[i:i + 1], alone[start + i])


def test_the_layer_runs_the_kernel_up_to_max_rows_then_torch(cpu_isa):
    x, weight, bias = _case(48, 256, seed=2)
    linear = nn.Linear(256, 48).bfloat16().requires_grad_(False)  # as a loaded model's
    linear.weight.data.copy_(weight)
    linear.bias.data.copy_(bias)
    model = nn.Sequential(linear)
    assert use_dense_kernels(model, cpu_isa) == 1
    layer = model[0]
    assert type(layer) is DenseLinear and layer.weight is linear.weight  # the same parameters, no copy
    bind_kernel_level(model, cpu_isa)
    bound = layer.bound_matmul()
    assert isinstance(bound, bf16_gemv.SmallBatchLinear)
    calls, kernel = [], bound._fn
    bound._fn = lambda *args: calls.append(args[1]) or kernel(*args)  # at this shape both paths give the same bits
    for m in range(1, 10):
        expected = (bf16_gemv.matmul(x[:m], weight, bias, cpu_isa) if m <= bf16_gemv.MAX_ROWS
                    else F.linear(x[:m], weight, bias))
        assert torch.equal(layer(x[:m]), expected)
        assert torch.equal(layer.bound_matmul()(x[:m]), expected)  # the bound step's callable is the module's
    assert calls == [m for m in range(1, bf16_gemv.MAX_ROWS + 1) for _ in range(2)]  # the kernel up to MAX_ROWS only
    layer.float()  # the weight's dtype changed: bound again, to F.linear
    assert not isinstance(layer.bound_matmul(), bf16_gemv.SmallBatchLinear)
    assert torch.equal(layer(x[:2].float()), F.linear(x[:2].float(), layer.weight, layer.bias))
    bind_kernel_level(model, None)  # native kernels off: torch's
    layer.bfloat16()
    assert not isinstance(layer.bound_matmul(), bf16_gemv.SmallBatchLinear)
    assert torch.equal(layer(x[:2]), F.linear(x[:2], layer.weight, layer.bias))
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_weights_the_kernel_cannot_read_in_place_go_to_torch(cpu_isa):
    """The kernel reads raw rows: a strided weight, or a replaced one of another shape, is never read as one."""
    x, weight, bias = _case(48, 256, seed=3)
    layer = DenseLinear(256, 48).bfloat16()
    layer.use_kernel_level(cpu_isa)
    layer.weight = nn.Parameter(torch.cat([weight, weight], dim=1)[:, ::2], requires_grad=False)  # strided
    assert not layer.weight.is_contiguous()
    assert torch.equal(layer(x[:2]), F.linear(x[:2], layer.weight, layer.bias))
    layer.weight.data = weight[:40].clone()  # another shape in place: bound again
    layer.bias.data = bias[:40].clone()
    assert torch.equal(layer(x[:2]), bf16_gemv.matmul(x[:2], weight[:40], bias[:40], cpu_isa))
    layer.weight.requires_grad_(True)  # autograd: torch's, with a graph
    assert layer(x[:2]).requires_grad
