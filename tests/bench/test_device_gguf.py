"""`pagellm bench device-gguf` rehearsed on the CPU at the tiny shape: the Q4_K_M file it writes, the numerics on a
carried sample (under Triton's interpreter, fp32), and both engines' rows (on a CPU the blocks run on the CPU's
kernels; planes and their crossovers are the GPU run's)."""

from __future__ import annotations

import json

import gguf
import torch

from pagellm.bench import gguf_files
from pagellm.loader.gguf_file import read_gguf_header
from tests.bench.cli_runner import run_cli
from tests.gpu import interpreter

T = gguf.GGMLQuantizationType
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)


def test_the_file_has_q4_k_m_s_mix_of_types(tmp_path):
    """llama.cpp's Q4_K_M: Q6_K for the head, and attn_v / ffn_down in layers 0, 3, 6, 7 of 8 (first and last
    eighth, every third between); every block's scales finite and small."""
    types = gguf_files.write_llama_gguf(TINY, tmp_path / "m.gguf")
    header = read_gguf_header(tmp_path / "m.gguf")
    stored = {t.name: t.ggml_type for t in header.tensors}
    assert all(stored[name] == kind for name, kind in types.items())
    assert [i for i in range(8) if stored[f"blk.{i}.ffn_down.weight"] == T.Q6_K] == [0, 3, 6, 7]
    assert stored["output.weight"] == T.Q6_K and stored["blk.1.attn_q.weight"] == T.Q4_K
    values = gguf.quants.dequantize(next(t for t in header.tensors if t.name == "blk.1.ffn_up.weight").data, T.Q4_K)
    assert abs(values).max() < 1 and 0.005 < abs(values).mean() < 0.1


def test_the_cpu_rehearsal_checks_a_sample_and_measures_both_engines(tmp_path, capsys):
    gguf_files.write_llama_gguf(TINY, tmp_path / "source.gguf")
    text = run_cli(capsys, "device-gguf", "--write-sample", str(tmp_path / "sample.gguf"), "--write-sample-from",
                   str(tmp_path / "source.gguf"))
    assert "wrote 4 tensors" in text  # two each of Q4_K and Q6_K (the file has no Q5_0)
    out = tmp_path / "gguf.json"
    with interpreter(not torch.cuda.is_available()):
        run_cli(capsys, "device-gguf", "--device", "cpu", "--shape", "tiny", "--npl", "1,2", "--pp", "8", "--tg",
                "2", "--sample", str(tmp_path / "sample.gguf"), "--commit", "abc", "--out", str(out))
    result = json.loads(out.read_text())
    numerics = result["checks"]["numerics"]
    assert len(numerics) == 4 * 6 and all(r["ok"] for r in numerics.values())  # each tensor at each kernel's M
    int8, bf16 = (max(r["relative_error"] for k, r in numerics.items() if f" {name} " in k) for name in ("gemv-q8",
                                                                                                    "gemv"))
    assert bf16 < 1e-5 < int8 < 0.02  # the activations' rounding shows, and stays small
    assert "not_run" in result["checks"]["crossovers"]  # timing needs CUDA
    rows = {(r["engine"], r["B"]): r for r in result["rows"]}
    assert set(rows) == {(e, b) for e in ("pagellm-gguf", "pagellm-dequantized") for b in (1, 2)}
    assert all(r["S_PP"] > 0 and r["S_TG"] > 0 and r["commit"] == "abc" and r["gpu"] == "CPU"
               for r in rows.values())
    assert rows[("pagellm-gguf", 1)]["weight_gib"] < 0.4 * rows[("pagellm-dequantized", 1)]["weight_gib"]
    assert rows[("pagellm-dequantized", 1)]["weights"].startswith("q4_k_m as ")  # the level's dense dtype


def test_the_qwen3_5_moe_file_is_q4_k_m_at_its_published_size():
    """The 35B-A3B file's tensors and types, from the shape alone (nothing written): about 21 GB, as Q4_K_M files
    of it are published; experts, attention and DeltaNet projections Q4_K or Q6_K, the router and the DeltaNet's
    per-head vectors F32."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from pagellm.bench.hybrid_gguf import _tensors, tensor_type
    from pagellm.bench.hybrid_shapes import write_hybrid_shape
    from pagellm.loader.safetensors import load_hf_config

    with tempfile.TemporaryDirectory() as tmp:
        config = load_hf_config(write_hybrid_shape("qwen3.5-35b-a3b", Path(tmp)))
    kinds = {name: (tensor_type(name, dims[-1], 40), dims) for name, dims in _tensors(config)}
    size = sum(np.prod(dims) // gguf.GGML_QUANT_SIZES[k][0] * gguf.GGML_QUANT_SIZES[k][1] for k, dims in kinds.values())
    assert 20.5e9 < size < 21.5e9
    assert kinds["blk.0.ffn_gate_up_exps.weight"][0] == T.Q4_K and kinds["blk.0.ffn_down_exps.weight"][0] == T.Q6_K
    assert kinds["blk.6.ffn_down_exps.weight"][0] == T.Q4_K and kinds["blk.3.attn_q.weight"][0] == T.Q4_K
    assert kinds["blk.0.ffn_gate_inp.weight"][0] == T.F32 and kinds["blk.0.ssm_a"][0] == T.F32


def test_the_hybrid_rehearsal_loads_its_experts_in_blocks(tmp_path, capsys):
    out = tmp_path / "gguf.json"
    run_cli(capsys, "device-gguf", "--device", "cpu", "--shape", "tiny-hybrid", "--npl", "1", "--pp", "8", "--tg",
            "2", "--out", str(out))
    rows = {r["engine"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"pagellm-gguf", "pagellm-dequantized"}
    # the tiny shape's rows are Q8_0 (not whole 256-column super-blocks) and its F32 vectors weigh: not 0.3x
    assert rows["pagellm-gguf"]["weight_gib"] < 0.7 * rows["pagellm-dequantized"]["weight_gib"]
