"""GGUF block formats kept as stored (kernels/cpu/gguf_blocks.py, csrc/quant_gguf.cpp): the repacked weights are the
file's, bit for bit; the matmul is the exact product of those weights with the int8-quantized activations up to
fp32 summation; every level gives the same bits."""

import gguf
import numpy as np
import pytest
import torch

from pagellm.kernels.cpu import gguf_blocks, layer_ops
from pagellm.kernels.build import native
from pagellm.loader import gguf_repack
from tests.kernels.gguf_blocks_builders import KERNEL_TYPES, T, gguf_tensor
from tests.kernels import requires_compiler

pytestmark = requires_compiler


def dequantized(data: np.ndarray, ggml_type: T, shape) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data, ggml_type).copy()).reshape(shape)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it (q8_activations.h), in float64: d * round(x / d) per 32 columns, d = max|x| / 127."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(d > 0, torch.round(groups / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return (codes.double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_are_the_files_weights(ggml_type, cpu_isa):
    data = gguf_tensor(ggml_type, 48, 512)
    weight = gguf_repack.repack(data, ggml_type, (48, 512))
    ids = torch.tensor([0, 47, 16, 5, 5])
    reference = dequantized(data, ggml_type, (48, 512))
    assert torch.equal(gguf_blocks.rows(weight, ids, cpu_isa), reference[ids])
    assert torch.equal(gguf_blocks.rows(weight, ids, cpu_isa, torch.bfloat16), reference[ids].bfloat16())


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 13, 40])
def test_matmul_is_the_exact_product_with_int8_activations(ggml_type, rows, cpu_isa):
    data = gguf_tensor(ggml_type, 64, 768, seed=rows)
    weight = gguf_repack.repack(data, ggml_type, (64, 768))
    x, bias = torch.randn(rows, 768), torch.randn(64)
    exact = int8_activations(x) @ dequantized(data, ggml_type, (64, 768)).double().T + bias.double()
    y = gguf_blocks.matmul(x, weight, bias, cpu_isa)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-6  # fp32 sums of exact products
    y16 = gguf_blocks.matmul(x.bfloat16(), weight, bias.bfloat16(), cpu_isa)
    exact16 = int8_activations(x.bfloat16()) @ dequantized(data, ggml_type, (64, 768)).double().T + bias.bfloat16().double()
    assert y16.dtype == torch.bfloat16 and ((y16.double() - exact16).norm() / exact16.norm()).item() < 1e-2


def test_activation_rounding_costs_little_against_the_dense_product(cpu_isa):
    data = gguf_tensor(T.Q8_0, 256, 1024)
    weight = gguf_repack.repack(data, T.Q8_0, (256, 1024))
    x = torch.randn(4, 1024)
    dense = x @ dequantized(data, T.Q8_0, (256, 1024)).T
    assert ((gguf_blocks.matmul(x, weight, None, cpu_isa) - dense).norm() / dense.norm()).item() < 0.01


@pytest.mark.across_levels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_levels_bit_identical(ggml_type):
    data = gguf_tensor(ggml_type, 32, 512, seed=3)
    weight = gguf_repack.repack(data, ggml_type, (32, 512))
    x = torch.randn(7, 512)
    results = native.each_level(lambda at: gguf_blocks.matmul(x, weight, None, at))
    first = next(iter(results.values()))
    assert all(torch.equal(first, y) for y in results.values()), list(results)


@pytest.mark.across_levels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_avx_vnni_build_equals_the_plain_avx2_build(ggml_type):
    if "avx2" not in native.host_levels() or "avx_vnni" not in native.cpu_flags():
        pytest.skip("needs a CPU with AVX2 and AVX-VNNI")
    data = gguf_tensor(ggml_type, 32, 512, seed=4)
    weight = gguf_repack.repack(data, ggml_type, (32, 512))
    x = torch.randn(9, 512)
    outs = []
    for extensions in (("avx_vnni",), ()):
        fn = gguf_blocks._KERNELS.at("avx2", extensions)["pagellm_gguf_matmul_q8"][1]  # the checked caller
        out = torch.empty(9, 32)
        fn(x, 9, 512, weight.format_id, *weight.tensors(), 32, 32, None, out.data_ptr(), native.DTYPE_CODES[out.dtype])
        outs.append(out)
    assert torch.equal(*outs)


# The bytes of each format's block that hold its scales (kept as quantized); the rest hold codes.
_SCALE_BYTES = {T.Q4_0: slice(0, 2), T.Q4_1: slice(0, 4), T.Q5_0: slice(0, 2), T.Q5_1: slice(0, 4),
                T.Q8_0: slice(0, 2), T.Q4_K: slice(0, 16), T.Q5_K: slice(0, 16), T.Q6_K: slice(192, 210)}


@pytest.mark.across_levels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("code_byte", [0xFF, 0x80])
def test_extreme_codes_keep_the_int16_sums_exact(ggml_type, code_byte):
    """Every code byte 0xFF (each code at its largest) or 0x80 (Q8_0's -128), activations at +-127: the plain
    avx2 build adds several chunks' vpmaddubsw pair sums in int16 before widening, which must not overflow;
    every build (without extensions) gives the generic build's bits."""
    data = gguf_tensor(ggml_type, 32, 512, seed=5).copy()
    blocks = data.reshape(-1, gguf.GGML_QUANT_SIZES[ggml_type][1])
    scales = blocks[:, _SCALE_BYTES[ggml_type]].copy()
    blocks[:] = code_byte
    blocks[:, _SCALE_BYTES[ggml_type]] = scales
    weight = gguf_repack.repack(data, ggml_type, (32, 512))
    x = torch.ones(4, 512)
    x[1], x[2, ::2] = -1.0, -1.0  # rows of +127, of -127, and alternating
    outs = {}
    for level in native.host_levels():
        fn = gguf_blocks._KERNELS.at(level, ())["pagellm_gguf_matmul_q8"][1]  # the checked caller
        out = torch.empty(4, 32)
        fn(x, 4, 512, weight.format_id, *weight.tensors(), 32, 32, None, out.data_ptr(), native.DTYPE_CODES[out.dtype])
        outs[level] = out
    exact = x @ dequantized(data, ggml_type, (32, 512)).T
    assert ((outs["generic"] - exact).norm() / exact.norm()).item() < 1e-3  # the codes are what was meant
    assert all(torch.equal(outs["generic"], out) for out in outs.values()), list(outs)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_resident_bytes_stay_near_the_files(ggml_type):
    data = gguf_tensor(ggml_type, 32, 1024)
    weight = gguf_repack.repack(data, ggml_type, (32, 1024))
    resident = sum(t.numel() * t.element_size() for t in weight.tensors())
    assert data.nbytes <= resident <= 1.03 * data.nbytes


def test_bad_input_is_refused(cpu_isa):
    weight = gguf_repack.repack(gguf_tensor(T.Q4_0, 16, 64), T.Q4_0, (16, 64))
    with pytest.raises(IndexError, match="out of range"):
        gguf_blocks.rows(weight, torch.tensor([16]), cpu_isa)
    with pytest.raises(ValueError, match="64 features"):
        gguf_blocks.matmul(torch.randn(2, 32), weight, None, cpu_isa)
    with pytest.raises(ValueError, match="cannot be kept in its blocks"):
        gguf_repack.repack(gguf_tensor(T.Q4_0, 8, 64), T.Q4_0, (8, 64))


def test_weights_side_by_side_write_one_output(cpu_isa):
    parts = [(T.Q5_0, 32), (T.Q8_0, 16), (T.Q4_K, 48)]
    data = [gguf_tensor(t, n, 512, seed=n) for t, n in parts]
    weights = [gguf_repack.repack(d, t, (n, 512)) for d, (t, n) in zip(data, parts)]
    x, bias = torch.randn(6, 512), torch.randn(96)
    joined = gguf_blocks.BoundMatmul(weights, bias, cpu_isa)(x)
    separate = torch.cat([gguf_blocks.matmul(x, w, None, cpu_isa) for w in weights], dim=1) + bias
    assert torch.equal(joined, separate)


def test_repacking_in_chunks_keeps_every_row(cpu_isa):
    """repack works 1024 rows at a time: a tensor of more than one chunk, not a whole number of them."""
    data = gguf_tensor(T.Q6_K, 2064, 256)
    weight = gguf_repack.repack(data, T.Q6_K, (2064, 256))
    assert torch.equal(gguf_blocks.rows(weight, torch.arange(2064), cpu_isa), dequantized(data, T.Q6_K, (2064, 256)))


def test_layer_rebinds_when_a_buffer_is_replaced(cpu_isa):
    from pagellm.layers.gguf_linear import GGUFLinear
    from pagellm.layers.kernel_user import bind_kernel_level

    first, second = (gguf_repack.repack(gguf_tensor(T.Q8_0, 32, 256, seed=s), T.Q8_0, (32, 256)) for s in (1, 2))
    layer, x = GGUFLinear([first]), torch.randn(2, 256)
    bind_kernel_level(layer, cpu_isa)
    assert torch.equal(layer(x), gguf_blocks.matmul(x, first, None, cpu_isa))
    bound = layer.bindings["matmul"][0]
    assert torch.equal(layer(x), gguf_blocks.matmul(x, first, None, cpu_isa))
    assert layer.bindings["matmul"][0] is bound  # bound once, not per call
    layer.qs0, layer.gp0 = second.qs, second.gp
    assert torch.equal(layer(x), gguf_blocks.matmul(x, second, None, cpu_isa))
    assert layer.bindings["matmul"][0] is not bound  # bound again, to the new buffers


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_an_fp32_output_of_bf16_activations_is_the_bf16_output_unrounded(ggml_type, cpu_isa):
    """What an LM head asks for: the same fp32 sums, not rounded to bf16 (bias included)."""
    data = gguf_tensor(ggml_type, 32, 512, seed=5)
    bias = torch.randn(32).to(torch.bfloat16).float()  # the same in either output dtype
    bound = gguf_blocks.BoundMatmul([gguf_repack.repack(data, ggml_type, (32, 512))], bias, cpu_isa)
    x = torch.randn(5, 512).to(torch.bfloat16)
    wide, narrow = bound(x, torch.float32), bound(x)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    assert not torch.equal(wide, narrow.float())  # really unrounded


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_the_fused_mlp_is_the_three_calls_bit_for_bit(ggml_type, cpu_isa):
    gate_up = gguf_repack.repack(gguf_tensor(ggml_type, 512, 512, seed=3), ggml_type, (512, 512))  # I = 256
    down_type = T.Q6_K if ggml_type != T.Q6_K else T.Q4_0  # the two formats differ, as in a Q4_K_M file
    down = gguf_repack.repack(gguf_tensor(down_type, 48, 256, seed=4), down_type, (48, 256))
    for biases in ((None, None), (torch.randn(gate_up.rows), torch.randn(48))):
        first, second = gguf_blocks.BoundMatmul([gate_up], biases[0], cpu_isa), gguf_blocks.BoundMatmul(
            [down], biases[1], cpu_isa)
        for rows in (1, 13, 40, 160):  # 160: x quantized by both threads
            x = torch.randn(rows, 512) * 3
            for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                for name, code in layer_ops.ACTIVATIONS.items():
                    xs = x.to(dtype)
                    separate = second(layer_ops.act_mul_unchecked(first(xs), name, cpu_isa))
                    fused = gguf_blocks.BoundMLP(first, second, code)(xs)
                    assert fused.shape == (rows, 48) and torch.equal(fused.view(bits), separate.view(bits))


def test_the_fused_mlp_over_wide_blocks_keeps_each_group_in_one_chunk(cpu_isa):
    """K = 8192: a chunk of gate/up block pairs under ~256 KB is one pair, rounded from one block to two."""
    gate_up = gguf_repack.repack(gguf_tensor(T.Q8_0, 448, 8192, seed=5), T.Q8_0, (448, 8192))  # I = 224: 7 groups
    down = gguf_repack.repack(gguf_tensor(T.Q4_0, 32, 224, seed=6), T.Q4_0, (32, 224))
    first = gguf_blocks.BoundMatmul([gate_up], torch.randn(448), cpu_isa)
    second = gguf_blocks.BoundMatmul([down], None, cpu_isa)
    for x in (torch.randn(5, 8192), torch.randn(5, 8192).bfloat16()):
        separate = second(layer_ops.act_mul_unchecked(first(x), "silu", cpu_isa))
        assert torch.equal(gguf_blocks.BoundMLP(first, second, 0)(x).float(), separate.float())


def test_the_fused_mlp_refuses_what_it_cannot_fuse():
    q8 = gguf_blocks.BoundMatmul([gguf_repack.repack(gguf_tensor(T.Q8_0, 64, 64), T.Q8_0, (64, 64))], None, "generic")
    two = gguf_blocks.BoundMatmul([gguf_repack.repack(gguf_tensor(t, 32, 64), t, (32, 64)) for t in (T.Q8_0, T.Q4_0)],
                                  None, "generic")
    down = gguf_blocks.BoundMatmul([gguf_repack.repack(gguf_tensor(T.Q8_0, 16, 32), T.Q8_0, (16, 32))], None,
                                   "generic")
    assert gguf_blocks.BoundMLP.fuses(q8, down) and not gguf_blocks.BoundMLP.fuses(two, down)
    assert not gguf_blocks.BoundMLP.fuses(q8, q8)  # down must take I = 32 columns
    with pytest.raises(ValueError, match="one-format gate/up"):
        gguf_blocks.BoundMLP(two, down, 0)
    with pytest.raises(ValueError, match="activation 2"):
        gguf_blocks.BoundMLP(q8, down, 2)


def _assert_one_call_is_the_two(fused, product, residual, cpu_isa):
    """fused(post_weight, weight, unit_offset) against layer_ops.add_rms_norm of (residual, product()), bit for bit:
    both norm flavours, with and without Gemma's post norm."""
    dtype, n = residual.dtype, residual.shape[-1]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for unit_offset in (True, False):
        norm_dtype = torch.float32 if unit_offset else dtype
        weight, post = torch.randn(n).to(norm_dtype), torch.randn(n).to(norm_dtype)
        for post_weight in (None, post):
            separate = layer_ops.add_rms_norm_unchecked(residual, product(), post_weight, weight, 1e-6, unit_offset,
                                                        cpu_isa)
            for a, b in zip(fused(post_weight, weight, unit_offset), separate):
                assert a.dtype == dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_the_matmul_with_its_add_and_norm_is_the_two_calls_bit_for_bit(ggml_type, cpu_isa):
    """An o projection and the residual add + norm after it in one call (BoundMatmul.add_norm), x in another dtype
    than the residual too (narrow attention)."""
    weight = gguf_repack.repack(gguf_tensor(ggml_type, 96, 256, seed=7), ggml_type, (96, 256))
    for bias in (None, torch.randn(96)):
        matmul = gguf_blocks.BoundMatmul([weight], bias, cpu_isa)
        for rows in (1, 7, 160):
            x = torch.randn(rows, 256) * 2
            for dtype in (torch.float32, torch.bfloat16):
                residual = (torch.randn(rows, 96) * 4).to(dtype)
                for xs in (x.to(dtype), x.bfloat16()):
                    _assert_one_call_is_the_two(
                        lambda post, w, unit: matmul.add_norm(xs, residual, post, w, 1e-6, unit),
                        lambda: matmul(xs, dtype), residual, cpu_isa)


def test_the_fused_mlp_with_its_add_and_norm_is_the_two_calls_bit_for_bit(cpu_isa):
    """A layer's MLP and the next layer's input norm in one call (BoundMLP.add_norm)."""
    gate_up = gguf_repack.repack(gguf_tensor(T.Q5_0, 512, 256, seed=8), T.Q5_0, (512, 256))  # I = 256
    down = gguf_repack.repack(gguf_tensor(T.Q4_K, 256, 256, seed=9), T.Q4_K, (256, 256))
    for biases in ((None, None), (torch.randn(512), torch.randn(256))):
        mlp = gguf_blocks.BoundMLP(gguf_blocks.BoundMatmul([gate_up], biases[0], cpu_isa),
                                   gguf_blocks.BoundMatmul([down], biases[1], cpu_isa), 1)
        for rows in (1, 13, 160):
            for dtype in (torch.float32, torch.bfloat16):
                x, residual = torch.randn(rows, 256).to(dtype), (torch.randn(rows, 256) * 4).to(dtype)
                _assert_one_call_is_the_two(lambda post, w, unit: mlp.add_norm(x, residual, post, w, 1e-6, unit),
                                            lambda: mlp(x), residual, cpu_isa)
    with pytest.raises(ValueError, match="residual"):
        mlp.add_norm(x, residual.float(), None, torch.ones(256), 1e-6, True)  # the last residual was bf16


def test_the_matmul_with_its_add_and_norm_refuses_what_it_cannot_take():
    two = gguf_blocks.BoundMatmul([gguf_repack.repack(gguf_tensor(t, 32, 64), t, (32, 64)) for t in (T.Q8_0, T.Q4_0)],
                                  None, "generic")
    one = gguf_blocks.BoundMatmul([gguf_repack.repack(gguf_tensor(T.Q8_0, 32, 64), T.Q8_0, (32, 64))], None, "generic")
    assert one.fuses_add_norm() and not two.fuses_add_norm()
    w = torch.ones(64)
    with pytest.raises(ValueError, match="expected one weight"):
        two.add_norm(torch.randn(1, 64), torch.randn(1, 64), None, w, 1e-6, True)
    with pytest.raises(ValueError, match="residual"):
        one.add_norm(torch.randn(1, 64), torch.randn(1, 31), None, torch.ones(32), 1e-6, True)
