"""Int8 / int4 weight-only layers (layers/quantized.py), GGUF 4-bit formats read exactly (loader/gguf_quant.py),
quantization at load (loader/quantization.py), and tiny models end to end against dense references.

References: a quantized layer is compared with the dense matmul of its own dequantized weights in fp32, with
the activations rounded as the path rounds them (the int kernels take bf16; torch's return bf16, the native
ones the activation dtype). Layers are tested with torch's kernels and layouts and, where they build, the
native ones (tests/kernels/test_quant_gemv.py tests those kernels on their own).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagellm import LLM, SamplingParams
from pagellm.config import ModelConfig
from pagellm.kernels.build import native
from pagellm.kernels.cpu import quant_gemv
from pagellm.layers.quant_codes import detect_int4_layout, int4_row_codes, int4_scale_zero
from pagellm.layers.quantized import (
    DENSE_FROM_ROWS, NATIVE_BELOW_ROWS, Int4Linear, Int8Linear, QuantizedEmbedding, QuantizedLinear, concat_linears,
    lm_head_logits, quantized_module)
from pagellm.loader.gguf_quant import group_affine_of
from pagellm.loader.gguf import gguf_weight_types, load_gguf_config
from pagellm.loader.model_loader import checkpoint_state_dict, load_model
from pagellm.loader.quantization import auto_scheme, plan_quantization, quantize_model, weight_bytes
from pagellm.loader.safetensors import iter_safetensors_weights, load_hf_config
from pagellm.models.registry import build_model
from tests.loader.gguf_builders import random_k_quant_blocks, write_tiny_gguf
from tests.models.paged_harness import PagedHarness
from tests.models.tiny_checkpoints import write_tiny_checkpoint

T = gguf.GGMLQuantizationType
LEVEL = native.default_level()  # what the layers here run at (tests/lower_levels.py repeats them at the others)
KERNEL, DENSE = 10**9, 1  # dense_from_rows forcing the int-kernel path / the dense-tile path
CLASSES = {"int8": Int8Linear, "int4": Int4Linear}
# torch's kernels and layouts always; the native ones (kernels/cpu/quant_gemv.py) at the level they exist at (avx512),
# where a failed build fails these cases rather than dropping them
NATIVE = [False] + ([True] if quant_gemv.promised(LEVEL) and native.compiler() is not None else [])


def exact_int4(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, q, scale, zero): w = (q - 8) * scale + zero with dyadic bf16 scale/zero and every group using 0 and 15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.randint(1, 64, (rows, cols // 32, 1), generator=g) * 2.0**-10
    zero = torch.randint(-64, 64, (rows, cols // 32, 1), generator=g) * 2.0**-8
    w = ((q - 8) * scale + zero).view(rows, cols)
    return w, q.view(rows, cols), scale.squeeze(-1), zero.squeeze(-1)


def reference(layer: QuantizedLinear, x: torch.Tensor, via_kernel: bool) -> torch.Tensor:
    x = x.to(torch.bfloat16) if via_kernel else x
    return x.double() @ layer.dequantize().double().T


def assert_close_to(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, via_kernel: bool) -> None:
    if dtype == torch.float32 and not via_kernel:  # fp32 dequantized tile, fp32 matmul
        torch.testing.assert_close(y.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    else:  # a bf16 result: one rounding (2^-9 relative) plus the accumulation order
        torch.testing.assert_close(y.double(), ref, atol=4e-3 * ref.abs().max().item(), rtol=8e-3)


# ---- layers ---------------------------------------------------------------------------------


def test_config_validates_quantization():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int3")
    assert ModelConfig(quantization="auto").quantization == "auto"


def test_int8_round_trip_of_representable_weights_is_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=g)
    q[:, 0] = 127
    scale = torch.randint(1, 255, (48,), generator=g) * 2.0**-12
    layer = Int8Linear.from_float(q.float() * scale[:, None])
    assert torch.equal(layer.qweight, q) and torch.equal(layer.scale.float(), scale)
    assert torch.equal(layer.dequantize(), q.float() * scale[:, None])


@pytest.mark.parametrize("native", NATIVE)
def test_int4_round_trip_of_representable_weights_is_exact(native):
    w, q, scale, zero = exact_int4(176, 96)  # torch's layout: 2 full blocks of 64 rows + a partial one of 48
    layer = Int4Linear.from_float(w, native=native)
    assert layer.layout.native == native and layer.packed.shape == (176, 48)
    ids = torch.arange(176)
    assert torch.equal(int4_row_codes(layer.packed, layer.layout, ids), q.to(torch.uint8))
    got_scale, got_zero = int4_scale_zero(layer.scales_and_zeros, layer.layout)
    assert torch.equal(got_scale, scale) and torch.equal(got_zero, zero)
    assert torch.equal(layer.dequantize(), w) and torch.equal(layer.rows(ids), w)
    some = torch.tensor([[175, 0], [17, 17]])
    assert torch.equal(layer.rows(some, torch.bfloat16), w[some.reshape(-1)].to(torch.bfloat16))


BF16_ACTIVATIONS = {"int8": {}, "int4": {"int8_activations": False}}  # the paths these tests pin down


def test_int4_layout_is_recognised():
    layout = detect_int4_layout()  # raises if torch packs in a layout we cannot read
    assert layout.block_n in (32, 64)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_both_paths_match_the_dequantized_reference(scheme, dtype, rows, native, monkeypatch):
    monkeypatch.setattr("pagellm.layers.quantized.TILE_ROWS", 128)  # several tiles, the last one partial
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(304, generator=g).to(dtype)
    layer = CLASSES[scheme].from_float(torch.randn(304, 96, generator=g) * 0.05, bias, native=native,
                                       **BF16_ACTIVATIONS[scheme])
    x = torch.randn(rows, 96, generator=g).to(dtype)
    outputs = {}
    for via_kernel, threshold in ((True, KERNEL), (False, DENSE)):
        layer.dense_from_rows = threshold
        y = outputs[via_kernel] = layer(x)
        assert y.dtype == dtype and y.shape == (rows, 304)
        assert_close_to(y, reference(layer, x, via_kernel) + bias.double(), dtype, via_kernel)
    scale = outputs[False].abs().max().item()  # the paths agree to a bf16 rounding or two of the largest output
    torch.testing.assert_close(outputs[True].float(), outputs[False].float(), atol=8e-3 * scale, rtol=1e-2)


@pytest.mark.skipif(not quant_gemv.q8_available(LEVEL), reason="int8 activations need the native kernels")
@pytest.mark.parametrize("head", [False, True])
def test_int8_activations_take_every_row_count(head, monkeypatch):
    """With int8 activations (the default where VNNI runs) an int4 layer, the vocab head too, runs
    int4_matmul_q8 at every M (no bf16-activation kernel, no dense tiles)."""
    monkeypatch.setattr("pagellm.layers.quantized._HEAD_ROWS", 100 if head else 10**6)
    g = torch.Generator().manual_seed(2)
    layer = Int4Linear.from_float(torch.randn(128, 64, generator=g) * 0.05, native=True)
    assert layer.int8_activations
    calls = []
    monkeypatch.setattr(layer, "bound_matmul", lambda q8, f=layer.bound_matmul: calls.append(q8) or f(q8))
    for rows in (1, 3, 4, 64, 600):
        calls.clear()
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        y = layer(x)
        assert calls == [True], rows
        assert torch.equal(y, quant_gemv.int4_matmul_q8(x, layer.packed, layer.scales_and_zeros, None, LEVEL))


def test_kernel_input_is_realigned(monkeypatch):
    """_weight_int8pack_mm loads activation rows with aligned AVX loads: a view at an odd offset segfaults it."""
    layer = Int8Linear.from_float(torch.randn(64, 64), dense_from_rows=KERNEL, native=False)
    storage = torch.randn(4 * 64 + 3, dtype=torch.bfloat16)
    x = storage[3:].view(4, 64)
    assert x.data_ptr() % 32
    assert_close_to(layer(x), reference(layer, x, True), torch.bfloat16, True)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype,head", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_dispatch_follows_the_measured_crossovers(scheme, dtype, head, native, monkeypatch):
    monkeypatch.setattr("pagellm.layers.quantized._HEAD_ROWS", 100 if head else 10**6)
    layer = CLASSES[scheme].from_float(torch.randn(128, 64), native=native, **BF16_ACTIVATIONS[scheme])
    key = (scheme, head, dtype == torch.bfloat16)
    dense_from = DENSE_FROM_ROWS[key]
    native_below = 0 if not native else min(NATIVE_BELOW_ROWS[key], dense_from)
    if native and scheme == "int4":  # its layout has no torch kernel: native, then dense tiles
        native_below = dense_from = NATIVE_BELOW_ROWS[key]
    calls = []
    for path in ("bound_matmul", "_torch_kernel", "_dense_matmul"):
        monkeypatch.setattr(layer, path, lambda *a, path=path, f=getattr(layer, path): calls.append(path) or f(*a))
    sizes = sorted({1, native_below - 1, native_below, dense_from - 1, dense_from} & set(range(1, 600)))
    for rows in sizes:
        calls.clear()
        layer(torch.randn(rows, 64).to(dtype))
        expected = "bound_matmul" if rows < native_below else "_torch_kernel" if rows < dense_from else "_dense_matmul"
        assert calls == [expected], rows


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_embedding_reads_dequantized_rows_and_is_the_lm_head(scheme):
    table = CLASSES[scheme].from_float(torch.randn(320, 64) * 0.1)
    embedding = QuantizedEmbedding(table, torch.bfloat16)
    ids = torch.tensor([[0, 319, 7], [256, 255, 7]])
    dense = table.dequantize()
    assert torch.equal(embedding(ids), dense[ids].to(torch.bfloat16))
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(embedding.logits(hidden), table(hidden))


# ---- GGUF 4-bit formats -----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_4bit_formats_read_exactly(qtype):
    rng = np.random.default_rng(0)
    rows, cols = 48, 512
    if qtype == T.Q4_K:
        raw = random_k_quant_blocks(rng, rows, cols, qtype)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    affine = group_affine_of(raw, qtype, (rows, cols))
    assert torch.equal(affine.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))  # bit for bit
    layer = Int4Linear.from_float(affine)
    assert torch.equal(int4_row_codes(layer.packed, layer.layout, torch.arange(rows)), affine.q)  # codes exact
    # only the scale and zero are rounded, to bf16 (the kernel's dtype): w = (q - 8) * bf16(s) + bf16(offset + 8s)
    s = affine.scale.to(torch.bfloat16).float()
    z = (affine.offset + 8 * affine.scale).to(torch.bfloat16).float()
    expected = (affine.q.view(rows, -1, 32).float() - 8) * s[..., None] + z[..., None]
    assert torch.equal(layer.dequantize(), expected.view(rows, cols))


def test_q4_k_with_bf16_exact_scales_round_trips_exactly():
    """d = 2^-8 and dmin = 2^-4 make d*sc and 8*d*sc - dmin*m bf16-exact: then nothing at all is lost."""
    rng = np.random.default_rng(1)
    raw = random_k_quant_blocks(rng, 16, 256, T.Q4_K).reshape(-1, 144)
    raw[:, 0:4] = np.array([2.0**-8, 2.0**-4], dtype=np.float16).view(np.uint8)
    affine = group_affine_of(raw, T.Q4_K, (16, 256))
    assert torch.equal(Int4Linear.from_float(affine).dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)).view(16, 256))


def test_auto_scheme_follows_bits_per_weight():
    assert [auto_scheme(t) for t in (T.Q4_K, T.Q4_0, T.Q5_0, T.Q5_K, T.Q6_K, T.Q8_0, T.F16, T.F32, None)] == \
        ["int4", "int4", "int4", "int4", "int8", "int8", None, None, None]


def test_gguf_auto_load_keeps_every_tensor_as_stored(tmp_path):
    """A llama GGUF (q/k rows permuted by llama.cpp) with mixed types: every kernel format stays in its blocks
    and holds exactly the file's weights (Q4_0 attn_q through the row unpermutation), F16 stays dense, and
    the resident bytes are the file's."""
    types = {"blk.0.attn_q.weight": T.Q4_0, "blk.1.attn_q.weight": T.Q4_1, "blk.0.attn_k.weight": T.Q8_0,
             "blk.0.ffn_down.weight": T.Q4_K, "blk.1.ffn_down.weight": T.Q6_K, "blk.0.ffn_gate.weight": T.Q5_0,
             "blk.1.ffn_gate.weight": T.Q5_1, "blk.0.ffn_up.weight": T.F16, "token_embd.weight": T.Q8_0}
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", types=types)
    loaded = load_model(str(tiny.path), torch.float32, torch.device("cpu"), with_tokenizer=False, quantization="auto")
    kept = {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.gate_proj",
            "model.layers.1.mlp.gate_proj", "model.embed_tokens"}
    assert loaded.quantization == dict.fromkeys(kept, "gguf")  # F16 / F32 tensors: dense
    model, names = loaded.model, {**{f"{n}.weight": n for n in kept}}
    for weight_name, path in names.items():
        module = model.get_submodule(path)
        table = module.table if path == "model.embed_tokens" else module
        assert torch.equal(table.dequantize(), torch.from_numpy(tiny.expected[weight_name])), path
    dense = load_model(str(tiny.path), torch.float32, torch.device("cpu"), with_tokenizer=False)
    ids = torch.tensor([3, 0, 63])
    assert torch.equal(model.model.embed_tokens(ids), dense.model.model.embed_tokens(ids))
    assert weight_bytes(model) < weight_bytes(dense.model)
    # The Q8_0 table as a (tied) LM head: its logits come back in fp32 even from bf16 hidden states.
    hidden = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    assert lm_head_logits(model.model.embed_tokens, hidden).dtype == torch.float32


def test_gguf_auto_falls_back_to_int4_int8_without_block_kernels(tmp_path):
    """Hosts without the block kernels (blocks_on=None) follow the file's bits per weight."""
    types = {"blk.0.attn_q.weight": T.Q4_0, "blk.0.attn_k.weight": T.Q8_0, "blk.0.ffn_up.weight": T.F16}
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", types=types)
    config = load_gguf_config(tiny.path)
    model = build_model(config, torch.float32, torch.device("meta"))
    plan = plan_quantization(model, "auto", LEVEL, gguf_weight_types(tiny.path, config), blocks_on=None)
    assert plan["model.layers.0.self_attn.q_proj"] == "int4" and plan["model.layers.0.self_attn.k_proj"] == "int8"
    assert "model.layers.0.mlp.up_proj" not in plan


def test_types_without_a_block_kernel_are_dequantized_with_a_warning(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", "llama", types={"blk.0.ffn_down.weight": T.Q3_K})
    with pytest.warns(RuntimeWarning, match="Q3_K tensor"):
        loaded = load_model(str(tiny.path), torch.float32, torch.device("cpu"), False, "auto")
    assert "model.layers.0.mlp.down_proj" not in loaded.quantization
    expected = torch.from_numpy(tiny.expected["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(loaded.model.get_submodule("model.layers.0.mlp.down_proj").weight, expected)


def test_hf_checkpoint_auto_is_none_and_device_is_checked(tmp_path):
    write_tiny_checkpoint("llama", tmp_path)
    assert load_model(str(tmp_path), torch.float32, torch.device("cpu"), False, "auto").quantization == {}
    with pytest.raises(ValueError, match="CPU only"):
        load_model(str(tmp_path), torch.float32, torch.device("meta"), False, "int8")


# ---- tiny models end to end ---------------------------------------------------------------------


def dequantized_checkpoint(model, source: Path, target: Path) -> Path:
    """An HF checkpoint of `model` with every quantized layer replaced by its dequantized weight."""
    dense = copy.deepcopy(model)
    for path, module in list(dense.named_modules()):
        owner, _, attr = path.rpartition(".")
        if isinstance(module, QuantizedEmbedding):
            dense.get_submodule(owner).register_module(attr, torch.nn.Embedding.from_pretrained(module.table.dequantize()))
        elif isinstance(module, QuantizedLinear) and not path.endswith(".table"):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.dequantize()
            if module.bias is not None:
                linear.bias.data = module.bias.detach().float()
            dense.get_submodule(owner).register_module(attr, linear)
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    state = {k: v.float().contiguous() for k, v in checkpoint_state_dict(dense).items() if v.is_floating_point()}
    save_file(state, str(target / "model.safetensors"))
    return target


def set_int8_activations(model, on: bool) -> None:
    for layer in model.modules():
        if isinstance(layer, Int4Linear):
            layer.int8_activations = on and layer.native


# (max, mean) logit error as a share of the largest logit: bf16 activations; int8 activations round more
ERROR_BOUNDS = {False: (0.05, 0.005), True: (0.08, 0.012)}


@pytest.mark.parametrize("family,scheme,int8_activations", [
    ("llama", "int8", False), ("gemma3", "int4", False), ("gemma3", "int4", True), ("llama3-rope-tied", "int4", False),
    ("llama3-rope-tied", "int4", True), ("qwen2", "int8", False)])
def test_tiny_model_logits_close_to_the_dequantized_model(tmp_path, family, scheme, int8_activations):
    if int8_activations and not quant_gemv.q8_available(LEVEL):
        pytest.skip("int8 activations need the native kernels (a C++ compiler)")
    write_tiny_checkpoint(family, tmp_path / "hf")
    config = load_hf_config(tmp_path / "hf")
    model = build_model(config, torch.float32)
    model.load_weights(iter_safetensors_weights(tmp_path / "hf"))
    plan = quantize_model(model, scheme, LEVEL)
    set_int8_activations(model, int8_activations)
    assert "model.embed_tokens" in plan and all(not isinstance(m, torch.nn.Embedding) for m in model.modules())
    reference = build_model(config, torch.float32)
    reference.load_weights(iter_safetensors_weights(dequantized_checkpoint(model, tmp_path / "hf", tmp_path / "deq")))
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = PagedHarness(model).prefill("a", prompt), PagedHarness(reference).prefill("a", prompt)
    error, size = (ours - ref).abs(), ref.abs().max()
    max_share, mean_share = ERROR_BOUNDS[int8_activations]
    assert error.max() <= max_share * size and error.mean() <= mean_share * size
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("family,scheme", [("llama", "int8"), ("gemma3", "int4"), ("qwen2", "int4")])
def test_llm_greedy_equals_the_dense_model_on_dequantized_weights(tmp_path, family, scheme):
    """Through the whole engine (streaming quantization at load, tied head, embedding lookup), with the
    quantized layers on their dense-tile path: fp32 tiles of exactly the dequantized weights, so the greedy ids
    must be identical. (The int-kernel path rounds activations and outputs to bf16; its closeness is checked by
    the logit tests above, as bit-identical greedy ids against an fp32 model cannot be promised there.)"""
    write_tiny_checkpoint(family, tmp_path / "hf")
    kwargs = dict(skip_tokenizer_init=True, kv_cache_memory=0.01)
    quantized = LLM(model=str(tmp_path / "hf"), quantization=scheme, **kwargs)
    assert isinstance(quantized.engine.model.model.embed_tokens, QuantizedEmbedding)
    layers = [m for m in quantized.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert {type(m).__name__ for m in layers} == {CLASSES[scheme].__name__}
    for layer in layers:
        layer.dense_from_rows = DENSE
    quantized.engine.runner.replan()  # the layers' paths changed after loading: plan again (modules now)
    dense = LLM(model=str(dequantized_checkpoint(quantized.engine.model, tmp_path / "hf", tmp_path / "deq")), **kwargs)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 20, 33)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    ids = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (quantized, dense)]
    assert ids[0] == ids[1]


# ---- the default model ----------------------------------------------------------------------------

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses in more than "
        "two hundred European cities had printed millions of books, and the price of a book fell so far that "
        "ordinary merchants could afford to own a small library of their own.")
# TEXT's first 64 ids from the GGUF's own tokenizer (loading that tokenizer takes ~7 s, a third of the test)
TEXT_IDS = [2, 818, 4083, 529, 506, 16386, 2686, 12502, 528, 506, 135461, 7691, 236764, 1056, 47660, 180558, 9292,
            79305, 6211, 1722, 236764, 4446, 236772, 5140, 19764, 532, 496, 7116, 21792, 2686, 236761, 25298, 25454,
            1518, 236764, 63581, 528, 919, 1082, 1156, 7549, 6693, 9979, 1053, 13762, 13889, 529, 6249, 236764, 532,
            506, 3385, 529, 496, 2260, 11561, 834, 2793, 600, 12822, 48197, 1451, 9546, 531]
# (min greedy agreement, max mean KL(dense || quantized)); measured on both paths (pytest -s prints them):
# int8 0.91 / 0.006, int4 0.81 / 0.17, auto 0.84-0.86 / 0.076; int8 activations: int4 0.83 / 0.174, auto 0.86 /
# 0.076 (over 256 positions of 4 texts: int8 0.94 /
# 0.006, int4 0.83 / 0.17, auto 0.84 / 0.078)
LIMITS = {"int8": (0.85, 0.02), "int4": (0.75, 0.25)}


@pytest.fixture(scope="module")
def dense_logits() -> torch.Tensor:
    """The dense fp32 model of the embedded GGUF's logits at TEXT_IDS: the reference of both tests below, computed
    once (a model load and a prefill; the model itself is not kept)."""
    dense = load_model(None, torch.float32, torch.device("cpu"), with_tokenizer=False).model
    return PagedHarness(dense, num_blocks=32).prefill("a", TEXT_IDS)


def test_default_model_accuracy_against_the_dense_gguf_model(dense_logits):
    """Greedy agreement (next-token argmax at 64 positions) and logit error of each scheme against the dense
    fp32 model of the same GGUF, on the dense-tile path, the int kernels with bf16 activations, and (int4) with
    int8 activations."""
    tokens, ref = TEXT_IDS, dense_logits
    for scheme, (min_agreement, max_kl) in LIMITS.items():
        model = load_model(None, torch.float32, torch.device("cpu"), False, scheme).model
        for path in ("dense", "kernel", "int8-activation kernel"):
            for layer in model.modules():
                if isinstance(layer, QuantizedLinear):
                    layer.dense_from_rows = DENSE if path == "dense" else KERNEL
            if path.startswith("int8") and (scheme == "int8" or not quant_gemv.q8_available(LEVEL)):
                continue  # int8 activations are for int4 layers
            set_int8_activations(model, path.startswith("int8"))
            logits = PagedHarness(model, num_blocks=32).prefill("a", tokens)
            agreement = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            error = (logits - ref).abs()
            kl = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            print(f"\n{scheme:>5} {path:>22} path: greedy agreement {agreement:.3f}, logit error max "
                  f"{error.max():.3f} mean {error.mean():.4f} (logit std {ref.std():.2f}), KL {kl.mean():.4f}", end="")
            assert agreement >= min_agreement and kl.mean() <= max_kl


def test_default_model_as_stored_is_near_the_dense_model(dense_logits):
    """auto keeps the GGUF's blocks (the file's exact weights): what differs from the dense fp32 model of the
    file is the activations' int8 rounding alone, which moves few next-token choices (llama.cpp rounds its
    activations alike; the measured figures beside its: docs/benchmarks/)."""
    ref = dense_logits
    model = load_model(None, torch.float32, torch.device("cpu"), False, "auto").model
    logits = PagedHarness(model, num_blocks=32).prefill("a", TEXT_IDS)
    agreement = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    print(f"\nauto (as stored): greedy agreement {agreement:.3f}, KL {kl:.4f}", end="")
    assert agreement >= 0.9 and kl <= 0.01


# ---- joined projections ---------------------------------------------------------------------------


def _linear(rows: int, cols: int, bias: bool, seed: int) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(cols, rows, bias=bias)
    layer.weight.data = torch.randn(rows, cols, generator=g) * 0.05
    if bias:
        layer.bias.data = torch.randn(rows, generator=g)
    return layer


@pytest.mark.parametrize("kind", ["dense", "int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_joined_layer_computes_the_parts_side_by_side(kind, bias):
    """concat_linears(parts)(x) is the parts' outputs concatenated: bit-identical for the int kernels (each
    output row computed as before), to fp32 rounding for dense (one GEMM over more columns)."""
    dense = [_linear(rows, 64, bias, seed) for seed, rows in enumerate((64, 32, 32))]
    parts = dense if kind == "dense" else [
        CLASSES[kind].from_float(p.weight.data, p.bias.data if bias else None, **BF16_ACTIVATIONS[kind])
        for p in dense]
    joined = concat_linears(parts)
    assert joined is not None and joined.out_features == 128
    for rows in (1, 7):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        if kind == "dense":
            x = x.float()
        expected = torch.cat([p(x) for p in parts], dim=-1)
        if kind == "dense":
            torch.testing.assert_close(joined(x), expected, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(joined(x), expected)


def test_layers_that_cannot_be_joined_stay_apart():
    a, b = _linear(32, 64, False, 0), _linear(32, 64, True, 1)
    assert concat_linears([a, b]) is None  # one with a bias, one without
    assert concat_linears([a, Int8Linear.from_float(b.weight.data)]) is None  # different kinds
    assert concat_linears([a, _linear(32, 48, False, 2)]) is None  # different inputs
    if quant_gemv.q8_available(LEVEL):
        q8, bf16 = (Int4Linear.from_float(a.weight.data, native=True, int8_activations=on) for on in (True, False))
        assert concat_linears([q8, bf16]) is None  # different activation paths
    int4 = Int4Linear.from_float(a.weight.data, native=True)
    assert type(concat_linears([int4, int4])) is Int4Linear


def test_checkpoint_state_dict_splits_joined_projections(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path / "hf")  # q/k/v with biases
    model = load_model(str(tmp_path / "hf"), torch.float32, torch.device("cpu"), with_tokenizer=False).model
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj is not None and not hasattr(attention, "q_proj")
    state = checkpoint_state_dict(model)
    written = dict(iter_safetensors_weights(tmp_path / "hf"))
    assert set(state) - {"lm_head.weight"} == set(written) - {"lm_head.weight"}
    for name in ("model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.weight"):
        assert torch.equal(state[name], written[name].float())
    quantized = load_model(str(tmp_path / "hf"), torch.float32, torch.device("cpu"), False, "int8").model
    with pytest.raises(ValueError, match="dense projections only"):
        checkpoint_state_dict(quantized)


@pytest.mark.skipif(native.compiler() is None, reason="without a compiler every level keeps torch's layouts")
def test_a_layer_is_built_for_the_level_asked_and_refuses_one_without_its_kernels(monkeypatch):
    """quantized_module asks only `level`'s kernels what they run (another level's build, e.g. the process
    default's, would be built for nothing, or fail); planning a layer where no kernel computes with its layout is
    a clear error then, not mid-step."""
    asked = []
    for library in (quant_gemv._Q8, quant_gemv._LAYOUT, quant_gemv._MATMULS):
        monkeypatch.setattr(library, "at", lambda at, *rest, _real=library.at: asked.append(at) or _real(at, *rest))
    layer = quantized_module("int4", torch.randn(32, 64), "generic")
    assert set(asked) == {"generic"} and layer.kernel_level == "generic"
    assert layer.layout.native and layer.int8_activations
    with pytest.raises(ValueError, match="an int4 layer built for kernel level 'generic' has no kernel at None"):
        layer.use_kernel_level(None)
    assert layer.kernel_level == "generic"  # unchanged: it still runs
