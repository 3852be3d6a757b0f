"""Verify steps of speculative decoding padded to one shape per (rows, drafts) and replayed from graphs
(runner/verify_inputs.py, runner/decode_graphs.py): on a CPU with the replaying stand-in for CUDA graphs, the
greedy ids of a run without speculation, drafts accepted and rejected, padding written only where no request reads
it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pagellm.engine as engine_module
from pagellm import LLM, SamplingParams
from pagellm.core.types import ScheduledRequest
from pagellm.runner.input_batch import SlotState
from pagellm.runner.verify_inputs import VerifyInputs, draft_buckets
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint
from tests.runner.test_decode_buckets import ReplayingRecorder, _runner_with
from tests.runner.test_speculative_engine import NGRAM, PROMPTS


def test_draft_buckets_double_up_to_the_most_drafts():
    assert draft_buckets(16) == (1, 2, 4, 8, 16) and draft_buckets(5) == (1, 2, 4, 5) and draft_buckets(1) == (1,)
    assert draft_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


def test_a_verify_step_pads_its_tokens_to_the_shape_and_its_table_to_the_scratch_block():
    """Blocks of 4, scratch block 99, a fixed table of 5 blocks: request 0 verifies 2 drafts at position 6 (its
    blocks 10, 11), request 1 decodes one token at position 3 (block 20); drafts bucket 4 (Q = 5), rows bucket 4."""
    inputs = VerifyInputs((1, 2, 4), (1, 2, 4), 4, torch.device("cpu"), scratch_block=99, max_blocks=5,
                          max_model_len=20)
    items = (ScheduledRequest("a", 0, (7, 30, 31), 6, (), True, num_draft=2),
             ScheduledRequest("b", 1, (8,), 3, (), True))
    states = [SlotState("a", SamplingParams(), [1], [], block_ids=[10, 11]),
              SlotState("b", SamplingParams(), [1], [], block_ids=[20])]
    key = inputs.key_for(items)
    assert key == (2, 2)  # the most drafts (2) fit bucket 2: Q = 3
    ids, positions, meta, logits_rows, offsets = inputs.prepare(items, states, key)
    assert ids.tolist() == [7, 30, 31, 8, 0, 0] and positions.tolist() == [6, 7, 8, 3, 4, 5]
    # request a's position 8 falls in its third block: not its own, the scratch block's
    assert meta.slot_mapping.tolist() == [11 * 4 + 2, 11 * 4 + 3, 99 * 4 + 0, 20 * 4 + 3, 99 * 4 + 0, 99 * 4 + 1]
    assert meta.block_tables.tolist() == [[10, 11, 99, 99, 99], [20, 99, 99, 99, 99]]
    assert meta.seq_lens.tolist() == [9, 6] and meta.query_start_loc.tolist() == [0, 3, 6]
    assert logits_rows.tolist() == [0, 1, 2, 3] and offsets == [0, 3] and inputs.padded_tokens == 2
    ids, positions, meta, _, _ = inputs.prepare(items[:1], states[:1], (4, 2))  # three padded rows
    assert ids.tolist()[3:] == [0] * 9 and positions.tolist()[3:] == [0, 1, 2] * 3
    assert meta.block_tables.tolist()[1:] == [[99] * 5] * 3 and meta.seq_lens.tolist() == [9, 3, 3, 3]
    assert inputs.key_for(items[:1] * 5) is None  # no rows bucket that large
    assert inputs.key_for((ScheduledRequest("c", 2, (1,) * 5, 6, (), True, num_draft=4),)) == (1, 4)
    assert inputs.key_for((ScheduledRequest("c", 2, (1,) * 5, 16, (), True, num_draft=4),)) is None  # past 20
    assert inputs.key_for((ScheduledRequest("c", 2, (1, 2), 6, (), True, num_draft=1, state_slot=0),)) is None
    with pytest.raises(ValueError, match="must ascend from 1"):
        VerifyInputs((2, 1), (1,), 4, torch.device("cpu"), 0, 2, 8)


def test_a_hybrid_verify_step_names_each_tokens_slot_and_rollback_row():
    """Request a (slot 2) verifies 2 drafts with rollback rows 7, 8; request b (slot 0) decodes one token: token j
    of a row runs at its slot while real (-1 past it), and the state after token j goes to draft j's row."""
    inputs = VerifyInputs((1, 2, 4), (1, 2, 4), 4, torch.device("cpu"), scratch_block=99, max_blocks=5,
                          max_model_len=20, recurrent=True)
    items = (ScheduledRequest("a", 0, (7, 30, 31), 6, (), True, num_draft=2, state_slot=2, draft_state_rows=(7, 8)),
             ScheduledRequest("b", 1, (8,), 3, (), True, state_slot=0))
    states = [SlotState("a", SamplingParams(), [1], [], block_ids=[10, 11]),
              SlotState("b", SamplingParams(), [1], [], block_ids=[20])]
    assert inputs.key_for(items) == (2, 2)
    assert inputs.key_for((dataclasses.replace(items[0], snapshot_writes=((8, 9),)),)) is None  # snapshots: eager
    _, _, meta, _, _ = inputs.prepare(items, states, (4, 2))
    assert meta.verify_slots.tolist() == [[2, 0, -1, -1], [2, -1, -1, -1], [2, -1, -1, -1]]
    assert meta.verify_rows.tolist() == [[7, -1, -1, -1], [8, -1, -1, -1], [-1, -1, -1, -1]]
    assert meta.state_slots.tolist() == [2, 0, -1, -1] and meta.state_slots_host == (2, 0, -1, -1)
    _, _, captured = inputs.capture_inputs((2, 4))
    assert captured.verify_slots.shape == (5, 2) and (captured.verify_slots == -1).all() and captured.for_graph


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("speculative, async_scheduling", [
    (NGRAM, False), ({**NGRAM, "num_speculative_tokens": 5, "adaptive": True}, False), (NGRAM, True)],
    ids=["k3", "k5-adaptive", "k3-async"])
def test_verify_steps_replayed_from_recorded_graphs_give_the_ids_without_speculation(tmp_path, monkeypatch,
                                                                                    speculative, async_scheduling):
    """Four requests, blocks of 4 (drafts and their padding cross block boundaries), prefix caching on: every
    (rows, drafts) shape recorded once, verify steps replayed, ids as without speculation. Async scheduling: a
    plain decode beside verify items feeds the token its last launch sampled (a placeholder) at its padded row."""
    write_tiny_checkpoint("llama", tmp_path, redraw=True)
    args = dict(skip_tokenizer_init=True, kv_cache_memory=0.01, block_size=4, max_num_seqs=8,
                async_scheduling=async_scheduling)
    with LLM(str(tmp_path), **args) as llm:
        plain = _ids(llm, PROMPTS, _greedy(24))
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
    with LLM(str(tmp_path), speculative_config=speculative, **args) as llm:
        runner = llm.engine.runner
        graphs, recorder = runner.verify_graphs, ReplayingRecorder()
        rows, drafts = (1, 2, 4, 8), draft_buckets(speculative["num_speculative_tokens"])
        assert graphs.inputs.row_buckets == rows and graphs.inputs.drafts == drafts and graphs.graphs == {}
        runner.decode_graphs.capture(recorder)
        graphs.capture(recorder)
        assert sorted(graphs.graphs) == sorted((r, k) for r in rows for k in drafts)
        ids, stats = _ids(llm, PROMPTS, _greedy(24)), llm.stats()
    assert ids == plain
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats  # accepted and rejected both
    assert graphs.replays > 0 and graphs.inputs.padded_tokens > 0
    assert stats["verify_graphs"].startswith(f"{len(rows) * len(drafts)} shapes (rows, drafts)")


def test_the_draft_models_decode_steps_replay_graphs_as_the_targets_do(tmp_path, monkeypatch):
    """Method draft_model: the draft engine runs with the target's step settings, so its decodes pad and replay
    too; the self-draft accepts everything."""
    write_tiny_checkpoint("llama", tmp_path, redraw=True)
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, speculative_config=spec) as llm:
        draft_runner = llm.engine.drafter.engine.runner
        assert draft_runner.decode_graphs is not None and draft_runner.verify_graphs is None  # it never verifies
        llm.engine.runner.verify_graphs.capture(ReplayingRecorder())
        ids, stats = _ids(llm, PROMPTS[:2], _greedy(12)), llm.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    assert llm.engine.runner.verify_graphs.replays > 0 and len(ids) == 2


def test_models_with_recurrent_state_verify_eagerly_where_their_kernels_would_not_skip_padding(tmp_path,
                                                                                                monkeypatch):
    """The CPU's Gated DeltaNet decode reads every slot it is given: a padding token would advance a state past
    the drafts, so no verify graphs."""
    write_hybrid_checkpoint("qwen3-next", tmp_path)
    monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
    with LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, speculative_config=NGRAM) as llm:
        assert llm.engine.runner.verify_graphs is None and llm.stats()["verify_graphs"] == "off (eager)"


# one family: Qwen3-Next's differs from Qwen3.5's in its fused input projections only, which its eager verify steps
# cover (test_speculative_engine), not in the padded, replayed step this checks; each run is long under the interpreter
@pytest.mark.parametrize("family", ["qwen3.5"])
def test_a_hybrid_model_s_verify_steps_replay_graphs_where_its_kernels_skip_padded_slots(tmp_path, monkeypatch,
                                                                                        family):
    """On the CUDA table's Gated DeltaNet decode (Triton under its interpreter, CPU tensors), whose kernels skip
    slot -1: verify steps of a hybrid model pad to their shapes and replay recorded graphs, each layer running
    token j of every request as a decode step and copying the state after it to the draft's rollback row; ids as
    the eager engine's without speculation, drafts accepted and rejected (so rollbacks read those rows)."""
    from pagellm.kernels.ops import triton_ops
    from pagellm.runner.backend import CpuBackend
    from tests.gpu import interpreter

    write_hybrid_checkpoint(family, tmp_path)
    args = dict(skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_seqs=4, dtype="float32")
    with LLM(str(tmp_path), **args) as llm:
        plain = _ids(llm, PROMPTS, _greedy(24))
    with interpreter(True):
        ops = triton_ops()
        monkeypatch.setattr(CpuBackend, "layer_ops", lambda self: ops)
        monkeypatch.setattr(engine_module, "ModelRunner", _runner_with(decode_graphs=True))
        with LLM(str(tmp_path), speculative_config=NGRAM, **args) as llm:
            runner = llm.engine.runner
            graphs, recorder = runner.verify_graphs, ReplayingRecorder()
            assert graphs is not None and graphs.inputs.recurrent
            runner.decode_graphs.capture(recorder)
            graphs.capture(recorder)
            ids, stats = _ids(llm, PROMPTS, _greedy(24)), llm.stats()
    assert ids == plain
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert graphs.replays > 0 and graphs.inputs.padded_tokens > 0
