"""`pagellm bench device-check` rehearsed on the CPU at the tiny shape: its parts and their reporting (on a CPU
without the static-cache peer, bf16 or the real shapes' memory, which only a GPU run exercises)."""

from __future__ import annotations

import json

import torch

from pagellm.cli import main
from tests.bench.cli_runner import run_cli


def test_the_cpu_rehearsal_checks_parity_and_measures_both_engines(tmp_path, capsys):
    out = tmp_path / "check.json"
    text = run_cli(capsys, "device-check", "--device", "cpu", "--shapes", "tiny", "--npl", "1,2", "--pp", "16",
                   "--tg", "4", "--peers", "hf", "--out", str(out))
    result = json.loads(out.read_text())
    parity = result["checks"]["parity"]
    assert parity["ok"] and parity["argmax_agreement"] == 1.0 and parity["max_abs_logit_difference"] < 1e-4
    assert "not_run" in result["checks"]["attention"]  # the Triton kernel is for CUDA (tests/gpu on a CPU)
    assert {(r["engine"], r["B"]) for r in result["rows"]} == {
        (engine, b) for engine in ("pagellm-eager", "hf-transformers", "pagellm-async") for b in (1, 2)}
    modes = result["checks"]["step_modes"]  # on a CPU: async scheduling alone (graphs need CUDA)
    assert set(modes) == {"eager", "async"} and modes["async"]["ids_equal"] and modes["async"]["ok"]
    assert modes["async"]["steps_launched_ahead"] > 0 and modes["async"]["flagged_syncs_per_step"] is None
    assert "serving" not in result  # a CPU runs no serving run unless asked
    assert all(r["S_PP"] > 0 and r["S_TG"] > 0 and r["shape"] == "tiny" for r in result["rows"])
    assert "S_TG t/s" in text


def test_an_unknown_shape_or_peer_is_named(capsys):
    assert main(["bench", "device-check", "--device", "cpu", "--shapes", "2b"]) == 2
    assert "--shapes: unknown shape(s) ['2b']; known: tiny, 1b, 8b, tiny-hybrid" in capsys.readouterr().err
    assert main(["bench", "device-check", "--device", "cpu", "--shapes", "tiny", "--peers", "vllm"]) == 2
    assert "--peers: unknown peer(s) ['vllm']; known: hf, hf-static" in capsys.readouterr().err


def test_the_kv_budget_fits_the_largest_batch_of_each_shape():
    """The host-RAM default (at most 4 GiB) cannot hold 64 x 576 tokens of the 8B shape: each shape gets its own."""
    from argparse import Namespace

    from pagellm.bench.device_check import kv_gib

    args = Namespace(npl=[1, 16, 64], pp=512, tg=64)
    needed_8b = 2 * 32 * 8 * 128 * 2 * 64 * 576 / 2**30  # K and V, 32 layers, 8 kv heads x 128, bf16: 4.5 GiB
    assert kv_gib("8b", args) >= needed_8b > 4
    assert kv_gib("1b", args) < kv_gib("8b", args)


def test_the_bf16_bound_scales_with_each_row():
    """An error at an output near 0 is judged against its row (the kernel rounds P to bf16), not against itself."""
    import torch

    from pagellm.bench.device_check import _bound

    exact = torch.tensor([[1.0, 1e-6], [0.5, -0.25]], dtype=torch.float64)
    assert torch.equal(_bound(exact, torch.bfloat16), torch.tensor([[2**-7], [2**-8]], dtype=torch.float64) + 1e-30)
    assert (_bound(exact, torch.float32) <= 2e-5).all()  # fp32: 1e-5 of the element and of the largest


def test_the_attention_check_runs_the_kernel_under_the_interpreter_on_a_cpu():
    """What the GPU run checks in fp32 and bf16, rehearsed in fp32 (tests/conftest.py imported triton for it):
    a mixed step, and two long decodes with their keys split 16 ways."""
    from pagellm.bench import device_check
    from tests.gpu import interpreter

    with interpreter(True):
        result = device_check.attention("cpu")
    assert list(result) == ["float32", "float32 split"] and all(r["ok"] for r in result.values()), result
    assert all(0 < r["worst_error_over_bound"] <= 1 for r in result.values())


def test_the_hybrid_shapes_are_the_published_models(tmp_path):
    """The dummy configs of the original documents' models build (on the meta device: no memory) to their
    published sizes: Qwen3.5-35B-A3B's 35B parameters, Qwen3.5-27B's 27B (the text models, no vision tower)."""
    from pagellm.bench.hybrid_shapes import write_hybrid_shape
    from pagellm.loader.safetensors import load_hf_config
    from pagellm.models.registry import build_model

    for name, billions in (("qwen3.5-35b-a3b", 35), ("qwen3.5-27b", 27)):
        model = build_model(load_hf_config(write_hybrid_shape(name, tmp_path / name)), torch.bfloat16, "meta")
        assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.5, name


def test_a_hybrid_shape_rehearses_beside_hf_and_serves_a_shared_prefix(tmp_path, capsys):
    """The hybrid MoE shape on the CPU: pagellm eager and with async scheduling, HF transformers' own
    implementation of the same weights, and a serving run of that shape whose prompts share 100 tokens (prefix
    hits through the state snapshots), twice against each server (memory read after each), then a prompt too long
    for any context: a 400. pagellm's rows keep the recurrent state in bf16, and say so."""
    out = tmp_path / "check.json"
    run_cli(capsys, "device-check", "--device", "cpu", "--shapes", "tiny-hybrid", "--npl", "1", "--pp", "8",
            "--tg", "2", "--peers", "hf", "--serve-prompts", "6", "--serve-shape", "tiny-hybrid",
            "--serve-shared-prefix", "100", "--serve-max-seqs", "4", "--serve-rate", "50", "--serve-rounds", "2",
            "--mamba-ssm-cache-dtype", "bfloat16", "--out", str(out))
    result = json.loads(out.read_text())
    assert {r["engine"] for r in result["rows"]} == {"pagellm-eager", "pagellm-async", "hf-transformers"}
    assert {r["state"] for r in result["rows"] if r["engine"].startswith("pagellm")} == {"bfloat16"}
    assert not result["errors"] and set(result["serving"]) == {"eager", "async"}
    assert all(r["completed"] == 6 and not r["failed"] and r["prefix_cache_hit_ratio"] > 0
               and len(r["memory_mib_after_each_round"]) == 2 and r["too_long_status"] == 400
               for r in result["serving"].values()), result["serving"]


def test_the_delta_prefill_check_times_the_kernel_beside_torch_and_checks_it(tmp_path, capsys):
    """--delta-prefill-shape rehearsed at the tiny hybrid's heads, the Triton kernel under the interpreter: a row per
    engine and case, the kernel within fp32's reach of torch's (fla-core needs a GPU driver: not among them here)."""
    from tests.gpu import interpreter

    out = tmp_path / "delta.json"
    with interpreter(True):
        run_cli(capsys, "device-check", "--device", "cpu", "--shapes", "", "--skip-checks", "--serve-prompts", "0",
                "--peers", "none", "--delta-prefill-shape", "tiny-hybrid", "--out", str(out))
    found = json.loads(out.read_text())["checks"]["delta_prefill"]
    assert found["ok"] and found["heads"] == {"Hk": 2, "Hv": 4, "dk": 16, "dv": 16}
    engines = {"torch", "triton", "triton-v64-tf32x3-w4", "triton-v32-tf32-w4", "triton-v32-tf32x3-w8",
               "triton-v64-tf32x3-w8"}
    assert {(r["engine"], r["requests"]) for r in found["rows"]} == {(e, n) for e in engines for n in (1, 3)}
    assert found["numerics"]["torch"] == {"out": 0.0, "state": 0.0} and 0 < found["numerics"]["triton"]["out"] < 1e-5
    assert main(["bench", "device-check", "--device", "cpu", "--shapes", "", "--delta-prefill-shape", "8b"]) == 2
    assert "--delta-prefill-shape: '8b' is not a hybrid shape" in capsys.readouterr().err


def test_an_engine_that_fails_in_the_delta_prefill_check_spares_the_others(monkeypatch):
    """A tile that does not build (or fla-core failing on a device) is an error of its own: the other engines'
    rows and numerics still come, each row handed to `keep` as it is measured."""
    from pagellm.bench import device_delta

    def broken(state, case):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(device_delta, "_engines", lambda: {"torch": device_delta._torch_rule, "broken": broken})
    kept = []
    found = device_delta.prefill_costs("tiny-hybrid", "cpu", cases=((2, 9),), repeats=1,
                                       keep=lambda result: kept.append(len(result["rows"])))
    assert found["errors"] == {"broken N=2 L=9": "RuntimeError: out of resources"}
    assert [r["engine"] for r in found["rows"]] == ["torch"] and kept == [1]
    assert found["numerics"]["torch"] == {"out": 0.0, "state": 0.0}


def test_the_moe_tiles_sweep_writes_entries_the_kernel_reads(tmp_path, capsys, monkeypatch):
    """--moe-tiles-shape rehearsed at the tiny hybrid's experts (dimensions rounded up to whole super-blocks), two
    blocks of pairs and one tile, under the interpreter: a row per timing, and one entry per token count that
    kernels/gpu/moe.tile_for reads back."""
    from pagellm.bench import device_moe_tiles
    from pagellm.kernels.reference.gguf_planes import T
    from tests.gpu import interpreter

    monkeypatch.setattr(device_moe_tiles, "REHEARSAL", dict(tokens=(3,), blocks_m=(16, 32), tiles=((64, 32, 4),)))
    out = tmp_path / "tiles.json"
    with interpreter(True):
        text = run_cli(capsys, "device-check", "--device", "cpu", "--shapes", "", "--skip-checks", "--serve-prompts",
                       "0", "--peers", "none", "--moe-tiles-shape", "tiny-hybrid", "--out", str(out))
        from pagellm.kernels.gpu import moe
    found = json.loads(out.read_text())["checks"]["moe_tiles"]
    assert len(found["rows"]) == 2 * 3  # blocks x (gate/up Q4_K, down Q4_K and Q6_K)
    (entry,) = found["entries"]
    assert (entry["experts"], entry["hidden"], entry["intermediate"], entry["tokens"]) == (8, 256, 256, 3)
    tile = moe.tile_for(8, 256, 256, 3, found["entries"])
    assert tile.block_m == entry["block_m"] in (16, 32)
    assert tile.launch("down", T.Q6_K) == tuple(entry["down"]["Q6_K"]) == (64, 32, 4)
    assert "moe_tiles.json entries:" in text
    assert main(["bench", "device-check", "--device", "cpu", "--shapes", "", "--moe-tiles-shape", "qwen3.5-27b"]) == 2
    assert "--moe-tiles-shape: 'qwen3.5-27b' is not a hybrid MoE shape" in capsys.readouterr().err
