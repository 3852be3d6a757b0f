"""`pagellm bench batched` end to end on a tiny model: columns and values are sane (not speed)."""

from __future__ import annotations

import csv
import json

import pytest

from pagellm.bench.batched import COLUMNS, batched_row, build_engine
from tests.bench.cli_runner import run_cli

KEYS = [c.key for c in COLUMNS]


def check_row(row: dict, shared: bool = False) -> None:
    pp, tg, b = int(row["PP"]), int(row["TG"]), int(row["B"])
    t_pp, t_tg, t = float(row["T_PP"]), float(row["T_TG"]), float(row["T"])
    assert int(row["N_KV"]) == (pp + b * tg if shared else b * (pp + tg))
    assert t_pp > 0 and t_tg > 0 and t == pytest.approx(t_pp + t_tg)
    assert float(row["S_PP"]) == pytest.approx((pp if shared else b * pp) / t_pp)
    assert float(row["S_TG"]) == pytest.approx(b * tg / t_tg)
    assert float(row["S"]) == pytest.approx(int(row["N_KV"]) / t)


def test_row_formulas_are_llama_batched_bench():
    row = batched_row(pp=128, tg=128, b=8, t_pp=0.5, t_tg=4.0)
    assert row == {"PP": 128, "TG": 128, "B": 8, "N_KV": 2048, "T_PP": 0.5, "S_PP": 2048.0,
                   "T_TG": 4.0, "S_TG": 256.0, "T": 4.5, "S": 2048 / 4.5}
    shared = batched_row(pp=128, tg=128, b=8, t_pp=0.5, t_tg=4.0, shared_prompt=True)
    assert shared["N_KV"] == 128 + 8 * 128 and shared["S_PP"] == 256.0


def test_batched_json_table_plot_and_instrumentation(tiny_model_dir, tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "rows.png"
    text = run_cli(capsys, "batched", "--model", str(tiny_model_dir), "--npl", "1,3", "--pp", "20", "--tg", "4",
                   "--out", str(out), "--plot", str(png))
    header = text.splitlines()[[i for i, line in enumerate(text.splitlines()) if "N_KV" in line][0]]
    assert [h.strip() for h in header.strip("|").split("|")] == [c.header for c in COLUMNS]
    rows = json.loads(out.read_text())
    assert [r["B"] for r in rows] == [1, 3]
    for row in rows:
        assert list(row)[:len(KEYS)] == KEYS
        check_row(row)
        assert row["prefill_tokens_computed"] == row["B"] * row["PP"]  # random prompts: nothing shared
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    for name in ("host ms", "copy ms", "model ms", "sample ms", "syncs/step", "reuse hit/miss"):
        assert name in text
    assert "step_reuse_misses" in text and "host_syncs_per_step 1.00" in text


def test_shared_prompt_csv_reports_what_the_prefix_cache_did(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rows.csv"
    text = run_cli(capsys, "batched", "--model", str(tiny_model_dir), "--npl", "1,4", "--pp", "40", "--tg", "3",
                   "--shared-prompt", "--out", str(out))
    assert "PP from cache" in text
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:len(KEYS)] == KEYS
    for row in rows:
        check_row(row, shared=True)
    # The first sequence computes all 40 tokens; the other 3 find 2 full blocks (32 tokens) cached
    # and compute the last 8. The B=4 row sees nothing of the B=1 row: the cache is reset between rows.
    assert [int(r["prefix_cache_hit_tokens"]) for r in rows] == [0, 3 * 32]
    assert [int(r["prefill_tokens_computed"]) for r in rows] == [40, 40 + 3 * 8]


def test_bad_out_suffix_is_rejected_before_measuring(tiny_model_dir):
    from pagellm.cli import main

    assert main(["bench", "batched", "--model", str(tiny_model_dir), "--out", "rows.txt"]) == 2


def test_kv_pool_too_small_names_the_flag(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        build_engine(str(tiny_model_dir), None, max_batch=64, max_prompt=200, max_new=40, kv_cache_memory=0.0001)


def test_reset_prefix_cache_refused_while_requests_run(tiny_model_dir):
    from pagellm.sampling_params import SamplingParams

    engine = build_engine(str(tiny_model_dir), None, max_batch=2, max_prompt=40, max_new=4)
    engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    assert engine.kv_cache.pool.num_cached_blocks > 0
    assert engine.reset_prefix_cache() is False and engine.kv_cache.pool.num_cached_blocks > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True and engine.kv_cache.pool.num_cached_blocks == 0


def test_stats_expose_input_copy_and_step_reuse(tiny_model_dir):
    from pagellm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), skip_tokenizer_init=True, kv_cache_memory=0.01)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    stats = llm.stats()
    assert stats["input_copy_ms_per_step"] > 0
    # Prefill, then a decode step that builds the layout, then one prepared from it by diff.
    assert stats["num_steps"] == 3
    assert stats["step_reuse_misses"] == 1 and stats["step_reuse_hits"] == 1
    assert stats["step_reuse_rate"] == 0.5


def test_batched_runs_on_a_hybrid_moe_model(tmp_path, capsys):
    """Gated DeltaNet + MoE (Qwen3-Next): state slots and snapshots under the batched bench, shared prompt."""
    from tests.models.tiny_checkpoints import write_hybrid_checkpoint

    write_hybrid_checkpoint("qwen3-next", tmp_path / "ckpt")
    out = tmp_path / "rows.json"
    run_cli(capsys, "batched", "--model", str(tmp_path / "ckpt"), "--npl", "1,3", "--pp", "40", "--tg", "4",
            "--shared-prompt", "--out", str(out))
    rows = json.loads(out.read_text())
    for row in rows:
        check_row(row, shared=True)
    # The shared prompt's 2 full blocks (and their state snapshots) serve the 2 later sequences.
    assert [r["prefix_cache_hit_tokens"] for r in rows] == [0, 2 * 32]


def test_batched_measures_a_shape_from_its_config_alone(tmp_path, capsys):
    """--load-format dummy: a directory holding only config.json is benchmarked (random weights, no tokenizer)."""
    from tests.models.tiny_checkpoints import TINY_CONFIGS

    TINY_CONFIGS["llama"]().save_pretrained(tmp_path)
    out = tmp_path / "rows.json"
    run_cli(capsys, "batched", "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--npl", "1,2",
            "--pp", "8", "--tg", "3", "--out", str(out))
    rows = json.loads(out.read_text())
    assert [r["B"] for r in rows] == [1, 2]
    for row in rows:
        check_row(row)


def test_step_mode_flags_reach_the_engine(tiny_model_dir, capsys):
    """--async-scheduling / --enforce-eager (unset: as `pagellm serve` on the device; on a CPU no overlap)."""
    text = run_cli(capsys, "batched", "--model", str(tiny_model_dir), "--npl", "2", "--pp", "8", "--tg", "4",
                   "--async-scheduling", "--enforce-eager")
    assert "async_scheduling True" in text and "decode_graphs off (eager)" in text
    text = run_cli(capsys, "batched", "--model", str(tiny_model_dir), "--npl", "2", "--pp", "8", "--tg", "4")
    assert "async_scheduling False" in text
