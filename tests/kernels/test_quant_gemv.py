"""The native int4 / int8 matmuls (kernels/cpu/quant_gemv.py) against float64 references and torch's kernels.

Reference: x rounded to bf16 (what every int kernel takes) times the exact dequantized weight, in float64. The
kernels sum in fp32, so they may differ from it by fp32 rounding (bounded relative to sum |x| |w|) plus, for
bf16 outputs, one bf16 rounding of the result.
"""

from __future__ import annotations

import copy as copy_module
import pickle

import pytest
import torch

from pagellm.kernels.build import native
from pagellm.kernels.cpu import quant_gemv
from pagellm.layers.kernel_user import bind_kernel_level
from pagellm.layers.quant_codes import group_affine_from_float, pack_int4
from pagellm.layers.quantized import Int4Linear, Int8Linear, QuantizedEmbedding, quantized_module
from tests.kernels import requires_compiler

# the bf16-activation kernels exist at the avx512 level only (elsewhere torch's serve: tests/layers); the int4
# layout's dequantizers at every level
pytestmark = [requires_compiler, pytest.mark.levels("avx512")]
ALL_LEVELS = pytest.mark.levels(*native.LEVELS)

KERNEL, DENSE = 10**9, 1  # dense_from_rows forcing the int-kernel path / the dense-tile path
CLASSES = {"int8": Int8Linear, "int4": Int4Linear}


def random_layer(scheme: str, rows: int, cols: int, bias: bool, dtype: torch.dtype, native: bool, level: str,
                 seed: int = 0):
    """A layer calling the kernels at `level` (`native`: in their layout, else in torch's)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=g) * 0.05
    b = (torch.randn(rows, generator=g) * 0.1).to(dtype) if bias else None
    bf16_activations = {"int8_activations": False} if scheme == "int4" else {}  # this file tests that kernel
    layer = CLASSES[scheme].from_float(weight, b, native=native, dense_from_rows=KERNEL, **bf16_activations)
    bind_kernel_level(layer, level)
    return layer


def assert_matches_reference(layer, x: torch.Tensor, y: torch.Tensor, rounded: bool | None = None) -> None:
    """`rounded`: the result went through bf16 (default: unless x is fp32, which the native kernels keep)."""
    w = layer.dequantize().double()  # exact: the weights the kernels compute with
    xb = x.to(torch.bfloat16).double().reshape(-1, layer.in_features)
    ref = xb @ w.T
    magnitude = xb.abs() @ w.abs().T  # what fp32 summation error scales with
    if layer.bias is not None:
        ref = ref + layer.bias.double()
    y = y.reshape(ref.shape).double()
    bound = 1e-6 * magnitude + 1e-30  # fp32 sums of exact products
    if rounded or (rounded is None and x.dtype != torch.float32):  # one rounding of the result (and of the bias)
        bound = bound + 2**-8 * ref.abs() + (0 if layer.bias is None else 2**-8 * layer.bias.double().abs())
    excess = ((y - ref).abs() - bound).max().item()
    assert excess <= 0, f"off the reference by {excess:.3g} beyond the bound"


@pytest.mark.parametrize("scheme,rows,cols", [("int4", 208, 96), ("int4", 16, 32), ("int4", 2048, 640),
                                              ("int8", 37, 96), ("int8", 1, 32), ("int8", 640, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_dequantized_reference(scheme, rows, cols, dtype, bias, cpu_isa):
    """M from 1 to 19 covers every row-count specialisation (1..8) and passes of 8 with a remainder; the
    large shapes take the threaded path, 208 rows is an odd number of int4 blocks, 37 an odd int8 row count."""
    layer = random_layer(scheme, rows, cols, bias, dtype, native=True, level=cpu_isa)
    g = torch.Generator().manual_seed(1)
    kernel = layer.bound_matmul()  # the native kernel itself, whatever M the layer would give it
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 19):
        x = (torch.randn(m, cols, generator=g) * 2).to(dtype)
        y = kernel(x)
        assert y.dtype == dtype and y.shape == (m, rows)
        assert_matches_reference(layer, x, y)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_torch_kernels_agree(scheme, dtype, cpu_isa):
    native_layer = random_layer(scheme, 304, 640, True, dtype, native=True, level=cpu_isa)
    torch_layer = random_layer(scheme, 304, 640, True, dtype, native=False, level=cpu_isa)
    assert torch.equal(native_layer.dequantize(), torch_layer.dequantize())
    x = torch.randn(6, 640).to(dtype)
    ours, theirs = native_layer.bound_matmul()(x).float(), torch_layer(x).float()
    # torch rounds to bf16 before adding the bias, the native kernel after: two bf16 roundings apart at most
    torch.testing.assert_close(ours, theirs, atol=2**-7 * theirs.abs().max().item(), rtol=2**-7)


def test_inputs_of_any_layout_and_dtype(cpu_isa):
    layer = random_layer("int4", 64, 96, True, torch.bfloat16, native=True, level=cpu_isa)
    batched = torch.randn(2, 3, 96).to(torch.bfloat16)
    y = layer(batched)
    assert y.shape == (2, 3, 64)
    assert_matches_reference(layer, batched, y)
    strided = torch.randn(5, 192).to(torch.bfloat16)[:, ::2]  # not contiguous
    assert_matches_reference(layer, strided, layer(strided))
    with pytest.raises(ValueError, match="96 features"):  # the kernel reads raw memory: K is checked
        layer.bound_matmul()(torch.randn(2, 64).to(torch.bfloat16))
    half = torch.randn(3, 96).half()  # converted to bf16 and back, as torch's kernels see it
    y = layer(half)
    assert y.dtype == torch.float16
    assert_matches_reference(layer, half, y.to(torch.bfloat16))


@ALL_LEVELS
def test_int4_layout_round_trips(cpu_isa):
    g = torch.Generator().manual_seed(2)
    affine = group_affine_from_float(torch.randn(48, 128, generator=g))
    codes, scales, layout = pack_int4(affine, native=True)
    assert layout.native and codes.shape == (48, 64) and scales.shape == (3, 4, 2, 16)
    ids = torch.tensor([0, 47, 16, 5, 5])
    assert torch.equal(quant_gemv.int4_codes(codes, ids), affine.q[ids])
    scale, zero = quant_gemv.int4_scale_zero(scales)
    assert torch.equal(scale, affine.scale.to(torch.bfloat16).float())
    assert torch.equal(zero, (affine.offset + 8 * affine.scale).to(torch.bfloat16).float())
    expected = (affine.q[ids].view(5, 4, 32).float() - 8) * scale[ids, :, None] + zero[ids, :, None]
    rows = quant_gemv.int4_rows(codes, scales, ids, torch.empty(5, 128), cpu_isa)
    assert torch.equal(rows, expected.view(5, 128))
    with pytest.raises(IndexError):
        quant_gemv.int4_rows(codes, scales, torch.tensor([48]), torch.empty(1, 128), cpu_isa)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dense_tiles_and_lookups_read_the_native_layout(scheme, monkeypatch, cpu_isa):
    monkeypatch.setattr("pagellm.layers.quantized.TILE_ROWS", 64)  # several tiles, the last one partial
    layer = random_layer(scheme, 176, 96, True, torch.float32, native=True, level=cpu_isa)
    x = torch.randn(40, 96)
    kernel = layer(x)
    layer.dense_from_rows = DENSE
    dense = layer(x)
    torch.testing.assert_close(dense, kernel, atol=2**-7 * kernel.abs().max().item(), rtol=2**-7)
    table = QuantizedEmbedding(layer, torch.bfloat16)
    ids = torch.tensor([[3, 175], [64, 3]])
    assert torch.equal(table(ids), layer.dequantize()[ids].to(torch.bfloat16))


def test_replaced_weights_are_used(cpu_isa):
    """The layer binds its kernel call to its buffers once; replacing a buffer must rebind it."""
    first, second = (random_layer("int4", 64, 96, False, torch.float32, native=True, level=cpu_isa, seed=s)
                     for s in (3, 4))
    x = torch.randn(2, 96)
    first(x)
    bound = first.bindings[False]  # the bf16-activation kernel's (int8_activations off)
    first(x)
    assert first.bindings[False] is bound  # bound once, not per call
    first.packed, first.scales_and_zeros = second.packed, second.scales_and_zeros
    assert torch.equal(first(x), second(x))
    assert first.bindings[False] is not bound and first.bindings[False].binds(second.packed,
                                                                              second.scales_and_zeros, None)


def test_copies_bind_their_own_tensors(cpu_isa):
    layer = random_layer("int4", 64, 96, True, torch.bfloat16, native=True, level=cpu_isa)
    x = torch.randn(2, 96).to(torch.bfloat16)
    expected = layer(x)
    for copy in (copy_module.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert torch.equal(copy(x), expected)
        copy.scales_and_zeros.zero_()  # its own tensors: the original is untouched
    assert torch.equal(layer(x), expected)


@ALL_LEVELS
def test_disabled_native_kernels_fall_back_to_torch(cpu_isa):
    assert not quant_gemv.available(None) and not quant_gemv.native_layout_available(None)
    # built for level None (native kernels off) as the loader builds them: torch's layout, torch's kernels
    int4 = quantized_module("int4", torch.randn(64, 96) * 0.05, None)
    int8 = quantized_module("int8", torch.randn(64, 96) * 0.05, None)
    assert not int4.native and not int4.layout.native and not int8.native
    assert int4.kernel_level is None and int8.kernel_level is None
    x = torch.randn(3, 96)
    for layer in (int4, int8):
        assert_matches_reference(layer, x, layer(x), rounded=True)  # torch's kernels return bf16
    assert quant_gemv.native_layout_available(cpu_isa)
