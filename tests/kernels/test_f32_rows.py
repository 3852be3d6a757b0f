"""The fp32 matmul of batch-independent rows (kernels/cpu/f32_rows.py) against a float64 reference, a row's bits
at any place in any batch and at every level, and the layers that take it (a MoE layer's router and shared-expert
gate through layers/dense.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from pagellm.kernels.build import native
from pagellm.kernels.cpu import bf16_gemv, f32_rows
from pagellm.kernels.cpu.dense_rows import KernelLinear
from pagellm.layers.dense import DenseLinear, use_dense_kernels
from tests.kernels import requires_compiler
from tests.layers.test_moe import HIDDEN, _config, _hf_block, _ours_from

pytestmark = requires_compiler


def _case(rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(40, cols, generator=g), torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)


@pytest.mark.parametrize("rows,cols", [(1, 2048), (7, 31), (37, 999), (256, 64)])
def test_products_are_the_exact_sums_within_fp32_rounding(cpu_isa, rows, cols):
    x, weight, bias = _case(rows, cols)
    out = f32_rows.matmul(x, weight, bias, cpu_isa)
    exact = x.double() @ weight.double().t() + bias.double()
    # a product's rounding and K / 16 + 4 lane sums' (each 2^-24 of the sums of magnitudes it covers, at most)
    bound = (x.double().abs() @ weight.double().abs().t() + bias.double().abs()) * (cols / 16 + 6) * 2.0**-24
    assert out.shape == (40, rows) and ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows,cols", [(1, 2048), (13, 100)])
def test_a_row_is_the_same_bits_at_any_place_in_any_batch(cpu_isa, rows, cols):
    x, weight, bias = _case(rows, cols, seed=1)
    whole = f32_rows.matmul(x, weight, bias, cpu_isa)
    for start in range(0, 30, 3):
        for count in (1, 2, 3, 5, 9):
            part = f32_rows.matmul(x[start:start + count], weight, bias, cpu_isa)
            assert torch.equal(part, whole[start:start + count]), (start, count)


@pytest.mark.across_levels
@pytest.mark.parametrize("rows,cols,count,with_bias", [(37, 999, 40, True), (5, 1, 5, False), (1, 15, 1, True),
                                                       (6, 16, 7, False), (9, 17, 3, True)])
def test_levels_bit_identical(rows, cols, count, with_bias):
    x, weight, bias = _case(rows, cols, seed=2)
    x, bias = x[:count], bias if with_bias else None
    results = native.each_level(lambda at: f32_rows.matmul(x, weight, bias, at))
    first = next(iter(results.values()))
    assert all(torch.equal(first, y) for y in results.values()), list(results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_moe_layer_s_router_and_gate_take_it_and_their_rows_do_not_depend_on_the_batch(cpu_isa, dtype):
    """use_dense_kernels gives the router and the shared-expert gate a batch-independent kernel at every M (the block
    names them): f32_rows for fp32, bf16_gemv for bf16 where its level has it; with torch's F.linear a token's gate
    changes with the number of tokens beside it."""
    config = _config(Qwen3NextConfig)
    block = _ours_from(_hf_block(Qwen3NextSparseMoeBlock, config), config, shared=True, normalize=True).to(dtype)
    use_dense_kernels(block, cpu_isa)
    exact = dtype == torch.float32 or bf16_gemv.available(cpu_isa)  # bf16: AVX-512 BF16 only, F.linear elsewhere
    for name in ("gate", "shared_expert_gate"):
        layer = getattr(block, name)
        assert isinstance(layer, DenseLinear) and layer.rows_exact
        bound = layer.bound_matmul()
        assert isinstance(bound, KernelLinear) == exact and (not exact or bound.max_rows is None)
    others = [m for m in block.shared_expert.modules() if isinstance(m, DenseLinear)]
    assert others and not any(m.rows_exact for m in others)  # only the layers the block names
    x = (torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    with torch.inference_mode():
        whole = block.gate(x), block.shared_expert_gate(x)
        for start in range(0, 40, 3) if exact else ():
            for layer, full in zip((block.gate, block.shared_expert_gate), whole):
                assert torch.equal(layer(x[start:start + 5]), full[start:start + 5])
        torch.testing.assert_close(whole[0].float(), F.linear(x, block.gate.weight).float(), rtol=1e-2, atol=1e-2)
