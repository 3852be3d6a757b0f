"""The GGUF gemv with int8 activations (kernels/gpu/gguf_gemv_q8.py) under Triton's interpreter: the activations'
quantization against the reference's (the CPU kernels' rounding), bit for bit, and the gemv of every format against
the exact product of the quantized activations and the file's weights (bias, odd rows, split K), within fp32's
summation error; its distance from the unquantized product within the activations' rounding."""

from __future__ import annotations

import importlib

import pytest
import torch

from pagellm.kernels.reference import gguf_planes
from pagellm.kernels.reference.gguf_planes import FORMATS
from pagellm.loader.gguf_planes import planes_of
from tests.gpu import DEVICE, under_interpreter
from tests.kernels.gguf_blocks_builders import gguf_tensor
from tests.loader.gguf_builders import T

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")


def _kernels():
    return under_interpreter(lambda: importlib.import_module("pagellm.kernels.gpu.gguf_matmul"))


def _planes(ggml_type, rows, cols, seed=0):
    return planes_of(gguf_tensor(ggml_type, rows, cols, seed), ggml_type, (rows, cols)).to(DEVICE)


def test_activations_quantize_as_the_cpu_kernels_do():
    """Groups of 32: an all-zero group (scale 0, codes 0), one dominated by a single value, values on a rounding
    tie (x / d = k + 0.5: half to even), and more groups than a program takes (33 groups of a 1056-column row)."""
    q8 = under_interpreter(lambda: importlib.import_module("pagellm.kernels.gpu.gguf_gemv_q8"))
    x = torch.randn(3, 1056, generator=torch.Generator().manual_seed(0))
    x[0, :32] = 0
    x[1, 32:64] = torch.linspace(-1, 1, 32) * 1e-3
    x[1, 40] = 50.0
    x[2, :32] = torch.arange(32) - 15.5  # d = 16.5 / 127: x / d of some land on a tie
    x[2, 0] = 127 * 0.5  # d = 0.5, codes 2 x: ties at .5 steps of 0.25 x
    codes, scales = q8.quantize_rows(x.to(DEVICE))
    want_codes, want_scales = gguf_planes.quantize_rows(x)
    assert torch.equal(scales.cpu(), want_scales) and torch.equal(codes.cpu(), want_codes)
    assert scales[0, 0] == 0 and not codes[0, :32].any()


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_the_int8_gemv_computes_the_exact_product_of_the_quantized_activations(ggml_type, m):
    kernels = _kernels()
    cols = 512 if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else 96
    planes = _planes(ggml_type, 37, cols, seed=m)
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, cols, generator=generator).to(DEVICE)
    bias = torch.randn(37, generator=generator).to(DEVICE)
    got = kernels.BoundPlanesMatmul([planes], bias, target_programs=8, int8_activations=True)(x).double()
    codes, scales = gguf_planes.quantize_rows(x)
    rounded = (codes.double().view(m, -1, 32) * scales.double()[..., None]).view(m, cols)
    weight = gguf_planes.dequantize(planes).double()
    exact = rounded @ weight.T + bias.double()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    # against the unquantized activations: each within half its group's step, times the weights
    step = (scales.double()[..., None] / 2).expand(m, cols // 32, 32).reshape(m, cols)
    unquantized = x.double() @ weight.T + bias.double()
    assert ((got - unquantized).abs() <= step @ weight.abs().T * 1.0001 + 1e-6).all()


@pytest.mark.parametrize("m", [1, 5])
def test_the_int8_gemv_splits_k_and_joined_segments_share_one_quantization(m, monkeypatch):
    """A long K over few rows is split (partial sums, then the reduce); a q/k/v-like layer of two segments of
    two formats quantizes its activations once."""
    kernels = _kernels()
    q8 = importlib.import_module("pagellm.kernels.gpu.gguf_gemv_q8")
    calls = []
    monkeypatch.setattr(kernels, "quantize_rows", lambda x: (calls.append(x.shape), q8.quantize_rows(x))[1])
    segments = [_planes(T.Q4_K, 16, 2048, seed=3), _planes(T.Q6_K, 8, 2048, seed=4)]
    bound = kernels.BoundPlanesMatmul(segments, None, target_programs=8, int8_activations=True)
    assert bound.splits(segments[0], kernels._gemv_block_m(m))[0] > 1
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    got = bound(x).double()
    assert calls == [(m, 2048)]
    codes, scales = gguf_planes.quantize_rows(x)
    rounded = (codes.double().view(m, -1, 32) * scales.double()[..., None]).view(m, 2048)
    exact = rounded @ torch.cat([gguf_planes.dequantize(s) for s in segments]).double().T
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
