"""Pure-decode steps padded to bucket sizes (runner/decode_inputs.py), the shapes CUDA graphs are captured at:
on a CPU the same buffers run without capture, and greedy ids must not change at any bucket edge, with prefix
caching, chunked prefill and preemption."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import pagellm.engine as engine_module
from pagellm import LLM, SamplingParams
from pagellm.core.types import ScheduledRequest
from pagellm.runner.decode_graphs import capture_or_run_eagerly
from pagellm.runner.decode_inputs import DecodeInputs
from pagellm.runner.input_batch import SlotState
from pagellm.runner.model_runner import ModelRunner
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

BUCKETS = (1, 2, 4)


def _runner_with(**forced):
    """ModelRunner on the engine's backend with these of its fields forced (decode_graphs, graph_sizes): on a CPU
    the config refuses graphs (there is nothing to capture), so the runner's graph path is reached here directly."""
    return lambda model, config, backend, *rest: ModelRunner(model, config, dataclasses.replace(backend, **forced),
                                                              *rest)


def _generate(path, buckets, monkeypatch, prompts, params, **engine_args):
    if buckets:
        monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(graph_sizes=buckets))
    with LLM(str(path), skip_tokenizer_init=True, **engine_args) as llm:
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        inputs = llm.engine.runner.decode_inputs
        stats = llm.stats()
    monkeypatch.undo()
    return ids, inputs, stats


@pytest.mark.parametrize("setting", [
    {}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 16, "n_ubatch": 8}, {"pool_blocks": 18},
], ids=["default", "prefix-cache-off", "chunked-prefill", "preemption"])
def test_greedy_ids_identical_with_padded_decode_steps(tmp_path, monkeypatch, setting):
    """Five requests finishing one after another run decode steps of B = 5 (past every bucket: unpadded), 4 (a
    bucket's edge), 3 (padded to 4), 2 and 1; two share a prefix. The padded rows write and read only the
    scratch block: a stray write into a request's blocks would change its ids. pool_blocks: a KV pool too small
    for every request at once (preemption)."""
    write_tiny_checkpoint("llama", tmp_path)
    prefix = list(range(40, 60))
    prompts = [prefix + [5, 6], prefix + [7], [9, 10, 11, 12], [13] * 20, [21, 22]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 9, 12, 15, 18)]
    engine_args = dict(setting)
    blocks = engine_args.pop("pool_blocks", None)
    if blocks is not None:  # blocks of 4 tokens: ~130 tokens in all against 72 of pool
        engine_args.update(block_size=4, kv_cache_memory=blocks * _block_bytes(tmp_path, 4) / 2**30)
    else:
        engine_args["kv_cache_memory"] = 0.01
    eager, _, _ = _generate(tmp_path, (), monkeypatch, prompts, params, **engine_args)
    padded, inputs, stats = _generate(tmp_path, BUCKETS, monkeypatch, prompts, params, **engine_args)
    assert padded == eager
    assert inputs.padded > 0  # some steps ran at a bucket larger than their batch
    assert blocks is None or stats["num_preemptions"] > 0


def _block_bytes(path, block_size: int) -> int:
    from pagellm.runner.model_runner import kv_cache_bytes_per_block

    with LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01) as llm:
        return kv_cache_bytes_per_block(llm.engine.model, block_size, llm.engine.kv_cache_dtype)


def test_padded_rows_feed_the_scratch_block_and_only_requests_sample():
    inputs = DecodeInputs(8, 4, torch.device("cpu"), buckets=(1, 2, 4), scratch_block=99, max_blocks=6)
    items = tuple(ScheduledRequest(f"r{i}", i, (7 + i,), 5 + i, (), True) for i in range(3))
    states = [SlotState(f"r{i}", SamplingParams(), [1], [], block_ids=[3 * i, 3 * i + 1]) for i in range(3)]
    input_ids, positions, meta, logits_rows, _ = inputs.prepare(items, states)
    assert input_ids.tolist() == [7, 8, 9, 0] and positions.tolist() == [5, 6, 7, 0]
    assert meta.seq_lens_host == (6, 7, 8, 1) and meta.block_tables.shape == (4, 6)
    assert meta.slot_mapping.tolist()[3] == 99 * 4 and logits_rows.tolist() == [0, 1, 2]
    assert inputs.rows_for(5, stateful=False) == 5 and inputs.rows_for(3, stateful=True) == 3
    with pytest.raises(ValueError, match="must ascend from 1"):
        DecodeInputs(8, 4, torch.device("cpu"), buckets=(4, 2), scratch_block=0, max_blocks=2)


def test_models_with_recurrent_state_are_not_padded(tmp_path, monkeypatch):
    """A padded row of a hybrid model would need a scratch state slot too: its steps run unpadded, same ids."""
    write_hybrid_checkpoint("qwen3-next", tmp_path)
    prompts, params = [[5, 6, 7], [8, 9], [10]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eager, _, _ = _generate(tmp_path, (), monkeypatch, prompts, params, kv_cache_memory=0.01)
    padded, inputs, _ = _generate(tmp_path, BUCKETS, monkeypatch, prompts, params, kv_cache_memory=0.01)
    assert padded == eager and inputs.padded == 0


class ReplayingRecorder:
    """CUDA graphs' stand-in on a CPU: record runs the forward once and keeps it; a replay reruns it over the
    tensors it was recorded with into the output it first made, which is all a graph's replay reads and
    writes. An input a step made afresh instead of filling a buffer in place would replay stale."""

    def __init__(self):
        self.recorded = 0

    def record(self, fn):
        out = fn()
        self.recorded += 1
        return (lambda: out.copy_(fn())), out


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_decode_steps_replayed_from_recorded_graphs_give_the_same_ids(tmp_path, monkeypatch, family):
    """The runner's graph path (runner/decode_graphs.py) with a replaying stand-in for CUDA graphs: every bucket
    recorded once, largest first; the steady decode steps replayed; greedy ids as the eager engine's. A MoE
    model's bound plan (its MoE blocks as their own steps) is recorded alike."""
    (write_tiny_checkpoint if family == "llama" else write_hybrid_checkpoint)(family, tmp_path)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 7, 10, 13, 16)]
    eager, _, _ = _generate(tmp_path, (), monkeypatch, prompts, params, kv_cache_memory=0.01)
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
    with LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_seqs=8) as llm:
        graphs = llm.engine.runner.decode_graphs
        assert llm.engine.runner.decode_inputs.buckets == (1, 2, 4, 8) and graphs.graphs == {}  # CPU: none
        recorder, forward, captured_for_graph = ReplayingRecorder(), graphs.forward, []
        graphs.forward = lambda ids, pos, meta: captured_for_graph.append(meta.for_graph) or forward(ids, pos, meta)
        graphs.capture(recorder)
        graphs.forward = forward
        assert recorder.recorded == 4 and sorted(graphs.graphs) == [1, 2, 4, 8]
        assert captured_for_graph == [True] * 4  # the kernels choose launch shapes a replay can reuse
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        replays, stats = graphs.replays, llm.stats()
        llm.engine.runner.replan()  # a new plan: the graphs held the old one's kernels
        assert graphs.graphs == {} and llm.stats()["decode_graphs"] == "dropped by a new layer plan"
    assert ids == eager and replays >= 10  # every steady decode step of the longest request
    assert stats["decode_graph_replays"] == replays and stats["decode_graphs"].startswith("4 buckets (1, 2, 4, 8)")
    assert stats["decode_graph_replay_rate"] == 1.0  # every pure-decode step of <= 8 requests fits a bucket


def test_graph_sizes_past_max_num_seqs_are_dropped(tmp_path, monkeypatch):
    write_tiny_checkpoint("llama", tmp_path)
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True, graph_sizes=(1, 3, 16)))
    with LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_seqs=8) as llm:
        assert llm.engine.runner.decode_inputs.buckets == (1, 3)
        assert llm.stats()["decode_graphs"] == "none captured"  # a CPU captures nothing


def test_default_buckets_pad_a_step_by_at_most_seven_rows():
    from pagellm.runner.decode_graphs import default_buckets

    assert default_buckets(1) == (1,) and default_buckets(6) == (1, 2, 4, 6)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


class FailingRecorder(ReplayingRecorder):
    def record(self, fn):
        if self.recorded == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().record(fn)


def test_a_failed_capture_runs_eagerly_unless_graphs_were_asked_for(tmp_path, monkeypatch, caplog):
    """enforce_eager unset: a forward that cannot be captured warns and serves eagerly, the buckets captured before
    the failure dropped; enforce_eager=False: the failure stops the start, naming --enforce-eager."""
    write_tiny_checkpoint("llama", tmp_path)
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
    with LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_seqs=8) as llm:
        graphs = llm.engine.runner.decode_graphs
        with caplog.at_level(logging.WARNING, logger="pagellm.runner"):
            assert capture_or_run_eagerly(graphs, FailingRecorder(), required=False) is None
        assert graphs.graphs == {} and "capture failed (operation not permitted" in caplog.text
        with pytest.raises(RuntimeError, match="--enforce-eager runs without them"):
            capture_or_run_eagerly(graphs, FailingRecorder(), required=True)
        assert graphs.graphs == {}


def test_a_hybrid_model_s_decode_steps_pad_and_replay_where_its_kernels_skip_padded_slots(tmp_path, monkeypatch):
    """Qwen3-Next on the CUDA table's Gated DeltaNet decode (Triton under its interpreter, on CPU tensors), whose
    kernels skip slot -1: its decode steps pad to the buckets (padded rows at slot -1, reading and writing no
    request's state) and replay recorded graphs, with the ids of the eager engine on the CPU's own kernels."""
    from pagellm.kernels.ops import triton_ops
    from pagellm.runner.backend import CpuBackend
    from tests.gpu import interpreter

    write_hybrid_checkpoint("qwen3-next", tmp_path)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 7, 10, 13)]
    eager, _, _ = _generate(tmp_path, (), monkeypatch, prompts, params, kv_cache_memory=0.01, dtype="float32")
    with interpreter(True):
        ops = triton_ops()
        monkeypatch.setattr(CpuBackend, "layer_ops", lambda self: ops)
        monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
        with LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_seqs=4,
                 dtype="float32") as llm:
            runner = llm.engine.runner
            assert runner.decode_inputs.buckets == (1, 2, 4) and runner.decode_inputs.pad_state_slots
            recorder = ReplayingRecorder()
            runner.decode_graphs.capture(recorder)
            ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            replays, padded = runner.decode_graphs.replays, runner.decode_inputs.padded
    assert ids == eager and recorder.recorded == 3 and replays >= 8 and padded > 0
