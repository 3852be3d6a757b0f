"""GGUF weights as a GPU keeps them (planes) and the Triton matmuls on them, on a CPU.

The planes against the gguf package's own dequantization (bit for bit), the kernels under Triton's interpreter
against the exact product in fp64 (each kernel the crossovers choose, odd shapes, splits over K, segments of
several formats side by side), and a GGUF loaded with the GPU's plan: what is kept in planes, what it weighs
beside the file, and a model step on the Triton kernels against the dense model of the same file.
"""

from __future__ import annotations

import dataclasses
import importlib

import gguf
import numpy as np
import pytest
import torch

from pagellm.kernels.ops import triton_ops
from pagellm.kernels.reference import gguf_planes
from pagellm.kernels.reference.gguf_planes import FORMATS, ReferencePlanesMatmul
from pagellm.layers.gguf_moe import GGUFMoeExperts, GGUFPlanesExperts
from pagellm.layers.gguf_planes import GGUFPlanesLinear
from pagellm.loader.gguf_file import read_gguf_header
from pagellm.loader.gguf_planes import planes_of
from pagellm.loader import model_loader
from pagellm.loader.model_loader import load_model
from pagellm.loader.quantization import weight_bytes
from pagellm.models.bound_layers import PlanSettings, plan_model, triton_step_kernels
from tests.gpu import DEVICE, under_interpreter
from tests.kernels.gguf_blocks_builders import gguf_tensor
from tests.loader.gguf_builders import T, TinyDims, write_tiny_gguf
from tests.loader.gguf_hybrid_builders import CASES, convert_to_gguf, write_hf_checkpoint, write_k_quant_moe_gguf
from tests.models.paged_harness import PagedHarness

pytest.importorskip("triton", reason="triton is not installed (PyTorch's CPU-only wheel does not bring it)")


def _kernels():
    return under_interpreter(lambda: importlib.import_module("pagellm.kernels.gpu.gguf_matmul"))


def _planes(ggml_type, rows, cols, seed=0):
    raw = gguf_tensor(ggml_type, rows, cols, seed)
    return raw, planes_of(raw, ggml_type, (rows, cols))


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_planes_hold_the_files_weights_at_its_size(ggml_type):
    raw, planes = _planes(ggml_type, 19, 512)
    expected = gguf.quants.dequantize(raw, ggml_type).reshape(19, 512)
    assert np.array_equal(gguf_planes.dequantize(planes).numpy(), expected)
    assert raw.nbytes <= planes.nbytes() <= 1.03 * raw.nbytes  # K formats: their 6-bit scales a byte each


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_the_triton_dequantization_and_row_lookup_are_exact(ggml_type):
    kernels = _kernels()
    _, planes = _planes(ggml_type, 21, 768, seed=1)
    planes = planes.to(DEVICE)
    expected = gguf_planes.dequantize(planes)
    out = torch.empty(21, 768, device=DEVICE)
    assert torch.equal(kernels.dequantize_into(planes, out), expected)
    ids = torch.tensor([20, 0, 7, 7], device=DEVICE)
    assert torch.equal(kernels.rows(planes, ids, torch.float32), expected[ids])


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("m,kernel", [(1, "gemv"), (3, "gemv"), (8, "gemv"), (9, "dot"), (33, "dot"),
                                      (70, "dense")])
def test_each_kernel_computes_the_exact_product(ggml_type, m, kernel, monkeypatch):
    """Odd rows (37: partial tiles), K of 2 super-blocks (legacy formats: 96, three 32-column groups), a bias,
    fp32 activations, within fp32's summation error of the exact product; the crossovers choose the kernel."""
    kernels = _kernels()
    monkeypatch.setitem(kernels.CROSSOVERS, ggml_type, kernels.Crossovers(gemv_max=8, dot_max=64))
    chosen = []
    for name in ("_gemv", "_dot", "_dense"):
        original = getattr(kernels.BoundPlanesMatmul, name)
        monkeypatch.setattr(kernels.BoundPlanesMatmul, name, lambda self, *a, _f=original, _n=name: (
            chosen.append(_n), _f(self, *a))[1])
    cols = 512 if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else 96
    _, planes = _planes(ggml_type, 37, cols, seed=m)
    planes = planes.to(DEVICE)
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, cols, generator=generator).to(DEVICE)
    bias = torch.randn(37, generator=generator).to(DEVICE)
    got = kernels.BoundPlanesMatmul([planes], bias, target_programs=8)(x)
    assert chosen == [f"_{kernel}"]
    exact = _exact(x, gguf_planes.dequantize(planes), bias)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("m", [1, 5])
def test_the_gemv_splits_k_and_sums_the_splits(m):
    """A long K over few rows is split (partial sums in fp32, then the reduce): equal to one program's sums."""
    kernels = _kernels()
    _, planes = _planes(T.Q4_K, 16, 2048, seed=3)
    planes = planes.to(DEVICE)
    bound = kernels.BoundPlanesMatmul([planes], None, target_programs=8)
    assert bound.splits(planes, kernels._gemv_block_m(m))[0] > 1
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    exact = _exact(x, gguf_planes.dequantize(planes), None)
    torch.testing.assert_close(bound(x).double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("m", [2, 20])
def test_segments_of_several_formats_write_side_by_side_in_fp16(m):
    """A joined q/k/v stored as Q4_0, Q5_0 and Q8_0, with a bias, fp16 activations and fp32 logits out: within
    fp16's rounding of the output (the gemv) and of the weights (the dot kernel's tiles are fp16)."""
    kernels = _kernels()
    parts = [_planes(t, rows, 64, seed=i)[1].to(DEVICE) for i, (t, rows) in enumerate(
        [(T.Q4_0, 32), (T.Q5_0, 16), (T.Q8_0, 16)])]
    bias = torch.randn(64).to(DEVICE)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.float16)
    bound = kernels.BoundPlanesMatmul(parts, bias)
    weight = torch.cat([gguf_planes.dequantize(p) for p in parts])
    exact = _exact(x, weight, bias)
    scale = exact.abs().max().item()
    torch.testing.assert_close(bound(x).double(), exact, rtol=2e-3, atol=2e-3 * scale)
    logits = bound(x, torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=2e-3, atol=2e-3 * scale)
    torch.testing.assert_close(ReferencePlanesMatmul(parts, bias)(x.float()).double(), exact, rtol=1e-5,
                               atol=1e-4)


LLAMA_TYPES = {f"blk.{i}.{name}.weight": kind for i in range(2) for name, kind in (
    ("attn_q", T.Q4_K), ("attn_k", T.Q4_K), ("attn_v", T.Q6_K), ("attn_output", T.Q4_K), ("ffn_gate", T.Q4_K),
    ("ffn_up", T.Q4_K), ("ffn_down", T.Q6_K))} | {"token_embd.weight": T.Q8_0, "output.weight": T.Q6_K}


def test_a_gguf_loads_in_planes_and_steps_on_the_triton_kernels(tmp_path, monkeypatch):
    """The GPU's plan of a Q4_K_M-like Llama (Q4_K, Q6_K, a Q8_0 token table and a Q6_K head, K of 256): every
    quantized tensor kept in planes at the file's size, q/k/v and gate/up joined, and a paged prefill then a
    decode on the Triton kernels equal to the dense model of the same file (fp32)."""
    tiny = write_tiny_gguf(tmp_path / "m.gguf", types=dict(LLAMA_TYPES), dims=TinyDims(hidden=256, head_dim=64,
                                                                                        intermediate=512))
    path = str(tiny.path)
    planes = load_model(path, torch.float32, torch.device(DEVICE), False, "auto", gguf_layout="cuda")
    dense = load_model(path, torch.float32, torch.device(DEVICE), False, "none")
    kept = {n: m for n, m in planes.model.named_modules() if isinstance(m, GGUFPlanesLinear)}
    assert {n.rsplit(".", 1)[-1] for n in kept} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "table",
                                                    "lm_head"}
    assert kept["model.layers.0.self_attn.qkv_proj"].formats == (T.Q4_K, T.Q6_K)  # q and k joined, then v
    file_bytes = sum(t.data.nbytes for t in read_gguf_header(path).tensors if t.ggml_type != T.F32)
    norms = sum(p.numel() * 4 for n, p in planes.model.named_parameters() if "norm" in n)
    assert file_bytes <= weight_bytes(planes.model) - norms <= 1.03 * file_bytes
    said = []  # what a GPU's start-up logs
    monkeypatch.setattr(model_loader.logger, "info", lambda message, *args: said.append(message % args))
    model_loader._log_gpu_weights(planes.model, tiny.path, planes.quantization, torch.bfloat16)
    assert "GiB file (1.0" in said[0] and "Q6_K: gemv to M=8, tiles to 256, then dequantized + cuBLAS" in said[0]
    harness, reference = PagedHarness(planes.model), PagedHarness(dense.model)
    ops = under_interpreter(triton_ops)
    harness.plan = plan_model(planes.model, PlanSettings(None, torch.float32, torch.float32, ops=ops),
                              kernels=under_interpreter(triton_step_kernels))
    assert "bound to the Triton kernels" in harness.plan.description
    prompt = torch.randint(3, 64, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    for feed in (prompt, [5]):
        got, expected = harness.step({"a": feed})["a"], reference.step({"a": feed})["a"]
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_moe_experts_load_in_planes_and_match_the_dense_experts(tmp_path, monkeypatch):
    """A Qwen3-MoE GGUF's Q4_K / Q6_K experts in planes, stacked [X, ...] on the device: the file's weights,
    and the experts' output on the Triton kernels equal to the dense experts' (tokens one by one and grouped)."""
    path = write_k_quant_moe_gguf(tmp_path)
    dense = load_model(path, torch.float32, torch.device(DEVICE), False)
    planes = load_model(path, torch.float32, torch.device(DEVICE), False, "auto", gguf_layout="cuda")
    name = "model.layers.0.mlp.experts"
    assert planes.quantization[name] == "gguf_planes_experts"
    layer, reference = planes.model.get_submodule(name), dense.model.get_submodule(name)
    assert isinstance(layer, GGUFPlanesExperts) and layer.gate_up_qs.device.type == DEVICE
    gate_up, down = layer.dequantized()
    assert torch.equal(gate_up, reference.gate_up_proj) and torch.equal(down, reference.down_proj)
    layer.use_ops(under_interpreter(triton_ops))  # every expert at once: kernels/gpu/moe.py
    monkeypatch.setattr(GGUFMoeExperts, "dispatch", lambda *a, **k: pytest.fail("an expert at a time ran"))
    for tokens in (1, 24):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        weights, ids = torch.rand(tokens, 2).to(DEVICE), torch.stack([torch.arange(tokens) % 8,
                                                                       (torch.arange(tokens) + 3) % 8], 1).to(DEVICE)
        got, expected = layer(x, weights, ids), reference(x, weights, ids)
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5  # fp32 sums in another order


@pytest.mark.parametrize("name", ["qwen3.5-moe-mtp-fused", "qwen3-next"])
def test_hybrid_and_moe_families_plan_their_blocks_for_a_gpu(tmp_path, name):
    """Every 2-D weight and the experts stored Q8_0, loaded with the GPU's plan: the blocks become planes (the
    experts too), and a paged prefill through the torch reference of the planes' matmul gives the dense model's
    logits of the same file (the same fp32 weights, the same products)."""
    family, conversion = CASES[name]
    write_hf_checkpoint(family, tmp_path / "hf")
    probe = convert_to_gguf(tmp_path / "hf", tmp_path / "probe.gguf", conversion)
    types = {n: T.Q8_0 for n, v in probe.items() if v.ndim >= 2 and v.shape[-1] % 32 == 0}
    convert_to_gguf(tmp_path / "hf", tmp_path / "model.gguf", dataclasses.replace(conversion, types=types))
    path = str(tmp_path / "model.gguf")
    dense = load_model(path, torch.float32, torch.device("cpu"), False, "none").model
    planes = load_model(path, torch.float32, torch.device("cpu"), False, "auto", gguf_layout="cuda").model
    assert any(isinstance(m, GGUFPlanesExperts) for m in planes.modules())
    assert sum(isinstance(m, GGUFPlanesLinear) for m in planes.modules()) > 4
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(PagedHarness(planes).prefill("a", prompt), PagedHarness(dense).prefill("a", prompt),
                               rtol=1e-5, atol=1e-5)
