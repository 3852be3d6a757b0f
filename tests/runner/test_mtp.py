"""Speculative decoding's method mtp (runner/mtp_drafter.py, models/mtp.py): the checkpoint's MTP head drafts as
the reference head built from HF's modules does, the ids are those of a run without speculation, and a head that
predicts the model has its drafts accepted."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint
from tests.models.tiny_mtp import make_head_predict_the_model, write_mtp_checkpoint

FAMILIES = ["qwen3.5-moe", "qwen3.5", "qwen3-next"]
# a shared 12-token prefix (prefix-cache hits at blocks of 4), odd lengths, one prompt of a single token
PROMPTS = [[9, 40, 77, 3, 18, 250, 61, 5, 130, 7, 88, 21, 14, 2], [9, 40, 77, 3, 18, 250, 61, 5, 130, 7, 88, 21, 199],
           [33, 12, 99, 4, 17, 3, 201, 56, 71], [42]]
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory=0.01, block_size=4)


def _mtp(k: int, adaptive: bool = False) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(path, prompts, params, speculative=None, spy=None, **engine_args):
    """-> (token ids, stats); spy(wanted, proposals) sees each step's proposals."""
    with LLM(str(path), speculative_config=speculative, **ENGINE, **engine_args) as llm:
        if spy is not None:
            propose = llm.engine.drafter.propose

            def spying(wanted):
                proposals = propose(wanted)
                spy(wanted, proposals)
                return proposals

            llm.engine.drafter.propose = spying
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()


@pytest.fixture(scope="module", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_mtp_checkpoint(request.param, path)


@pytest.mark.parametrize("bound_layers", ["1", "0"])
def test_the_heads_first_drafts_are_the_reference_heads(family_checkpoint, bound_layers, monkeypatch):
    """Two prompts of other lengths prefilled together: each request's first proposal (the head caught up on its
    whole prompt, then two more passes through the scratch blocks) is the HF-built head's greedy drafts, with the
    head's layer bound to the kernels and with its modules."""
    monkeypatch.setenv("PAGELLM_BOUND_LAYERS", bound_layers)
    path, reference = family_checkpoint
    prompts = [PROMPTS[0], PROMPTS[2]]
    first: dict[str, tuple[int, ...]] = {}
    ids, _ = _run(path, prompts, _greedy(8), _mtp(3),
                  spy=lambda wanted, proposals: [first.setdefault(rid, d) for rid, d in proposals.items()])
    for i, prompt in enumerate(prompts):
        token, drafts = reference.greedy(prompt, 3)
        assert ids[i][0] == token
        assert first[f"req-{i}"] == tuple(drafts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_ids_identical_with_the_head_drafting(family_checkpoint, async_scheduling):
    """Four requests, chunked prefill, blocks of 4 (drafts cross them), prefix hits on the shared prefix, steps
    launched ahead or not: the ids of a run without speculation."""
    path, _ = family_checkpoint
    args = dict(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    plain, _ = _run(path, PROMPTS, _greedy(20), **args)
    spec, stats = _run(path, PROMPTS, _greedy(20), _mtp(3), **args)
    assert spec == plain
    assert stats["spec_draft_tokens"] > 0


@pytest.mark.parametrize("family, noise", [("qwen3.5-moe", 0.0), ("qwen3.5", 0.0), ("qwen3.5-moe", 0.05)])
def test_a_head_that_predicts_the_model_has_its_drafts_accepted(tmp_path, family, noise):
    """A head made to predict the model (tiny_mtp.make_head_predict_the_model) is accepted at every draft, a
    noisy one at some: the accepted tokens, the rolled-back state and the head's KV after a rejection all give
    the ids of a run without speculation. (The dense model's greedy text soon repeats one token: only the MoE
    one's tells a noisy head's misses.)"""
    write_mtp_checkpoint(family, tmp_path)
    make_head_predict_the_model(tmp_path, noise)
    plain, _ = _run(tmp_path, PROMPTS, _greedy(24), max_num_batched_tokens=16)
    spec, stats = _run(tmp_path, PROMPTS, _greedy(24), _mtp(4), max_num_batched_tokens=16)
    assert spec == plain
    if noise:
        assert 0.05 < stats["spec_acceptance_rate"] < 0.9, stats
    else:
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3.5, stats


def test_a_seeded_request_emits_its_own_tokens_with_the_head_drafting(tmp_path):
    """Sampled requests verify one-hot proposals (the head's greedy drafts): their tokens are those drawn without
    speculation, with the default adaptive draft length."""
    write_mtp_checkpoint("qwen3.5-moe", tmp_path)
    make_head_predict_the_model(tmp_path, noise=0.1)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=s, top_k=30) for s in range(4)]
    plain, _ = _run(tmp_path, PROMPTS, params)
    spec, stats = _run(tmp_path, PROMPTS, params, {"method": "mtp"})
    assert spec == plain
    assert stats["spec_draft_tokens"] > 0


def test_without_a_head_method_mtp_is_a_clear_error(tmp_path):
    llama, hybrid, no_weights = (tmp_path / name for name in ("llama", "hybrid", "no-weights"))
    write_tiny_checkpoint("llama", llama)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MTP head"):
        LLM(str(llama), speculative_config=_mtp(1), **ENGINE)
    write_hybrid_checkpoint("qwen3.5", hybrid)
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP head"):
        LLM(str(hybrid), speculative_config=_mtp(1), **ENGINE)
    write_mtp_checkpoint("qwen3.5", no_weights)
    (no_weights / "mtp.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing .*mtp\."):
        LLM(str(no_weights), speculative_config=_mtp(1), **ENGINE)


def test_the_head_s_scratch_blocks_are_inside_the_kv_budget(family_checkpoint):
    """The drafts' scratch blocks are bound past the pool's (runner/mtp_drafter.py): the KV memory bound in all,
    scratch included, stays within kv_cache_memory (one padded decode block aside), as without the head."""
    path, _ = family_checkpoint
    budget = ENGINE["kv_cache_memory"] * 2**30
    for speculative in (None, _mtp(5)):
        with LLM(str(path), speculative_config=speculative, **ENGINE) as llm:
            engine = llm.engine
            bound = engine.model.attention_layers()[0].key_cache.shape[0]  # blocks of every layer's K and V
            assert (bound - 1) * engine.kv_bytes_per_block <= budget, (speculative, bound)


def test_the_default_draft_length_is_one_for_the_head_sixteen_otherwise():
    from pagellm.config import speculative_config_from

    assert speculative_config_from({"method": "mtp"}).num_speculative_tokens == 1
    assert speculative_config_from({"method": "ngram"}).num_speculative_tokens == 16
    assert speculative_config_from({"method": "mtp", "num_speculative_tokens": 3}).num_speculative_tokens == 3


def test_rows_of_steps_whose_tokens_are_not_back_are_kept_and_a_position_fed_again_replaces_its_rows(
        family_checkpoint):
    """Steps launched ahead leave rows before the tokens that follow them reach the host: the head catches up on
    the rows whose next token is known, keeps the rest, and a position fed again (a rejected draft's) replaces
    the rows from it on."""
    from types import SimpleNamespace

    import torch

    path, _ = family_checkpoint
    with LLM(str(path), speculative_config=_mtp(2), **ENGINE) as llm:
        drafter = llm.engine.runner.mtp
        hidden = torch.arange(8.0)[:, None].expand(8, 4)  # row i: all i

        def step(position, rows, first_row):
            item = SimpleNamespace(request_id="r", token_ids=[0] * rows, start_position=position)
            drafter.record([item], hidden, [first_row])

        step(0, 3, 0)  # a prefill of positions 0..2: rows 0, 1, 2
        step(3, 1, 5)  # a decode launched ahead: position 3 from row 5
        request = SimpleNamespace(request_id="r", num_computed_tokens=4, all_token_ids=[7, 8, 9, 10])
        (_, tokens, first, end, rows), = drafter._catch_up_batch([request])  # token 4 not back yet
        assert (tokens, first, end, rows[:, 0].tolist()) == ([8, 9, 10], 0, 3, [0.0, 1.0, 2.0])
        step(4, 3, 1)  # a verify step at 4..6, rows 1, 2, 3
        step(5, 2, 6)  # its drafts rejected after position 4; position 5 fed again: rows 6, 7
        assert drafter._rows["r"][0] == 3 and drafter._rows["r"][1][:, 0].tolist() == [5.0, 1.0, 6.0, 7.0]


def test_a_gguf_files_head_drafts_as_the_checkpoints(tmp_path):
    """The head converted to GGUF as llama.cpp's converter does (its layer as the block after the model's, fc and
    its norms as nextn tensors, the norms stored + 1): the first drafts are the HF-built head's."""
    from tests.loader.gguf_hybrid_builders import convert_to_gguf

    reference = write_mtp_checkpoint("qwen3.5-moe", tmp_path / "hf")
    convert_to_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    first: dict[str, tuple[int, ...]] = {}
    prompts = [PROMPTS[0], PROMPTS[2]]
    ids, _ = _run(tmp_path / "model.gguf", prompts, _greedy(8), _mtp(3),
                  spy=lambda wanted, proposals: [first.setdefault(rid, d) for rid, d in proposals.items()])
    for i, prompt in enumerate(prompts):
        token, drafts = reference.greedy(prompt, 3)
        assert (ids[i][0], first[f"req-{i}"]) == (token, tuple(drafts))


def test_a_written_qwen35moe_gguf_with_a_predicting_head_is_accepted(tmp_path):
    """bench/hybrid_gguf.py's file with an MTP head (Q4_K_M's types, blocks as stored) made to predict the model:
    every draft accepted, the ids of a run without speculation."""
    from pagellm.bench.hybrid_gguf import write_hybrid_gguf

    write_hybrid_gguf("tiny-hybrid", tmp_path / "model.gguf", mtp=True, head_predicts=True)
    plain, _ = _run(tmp_path / "model.gguf", PROMPTS, _greedy(16))
    spec, stats = _run(tmp_path / "model.gguf", PROMPTS, _greedy(16), _mtp(3))
    assert spec == plain
    assert stats["spec_acceptance_rate"] > 0.95, stats


def test_no_rows_are_kept_for_requests_that_ended_or_were_aborted(family_checkpoint):
    path, _ = family_checkpoint
    with LLM(str(path), speculative_config=_mtp(2), **ENGINE) as llm:
        engine = llm.engine
        first, second = (engine.add_request(p, _greedy(12)) for p in PROMPTS[:2])
        for _ in range(3):
            engine.step()
        assert {first, second} <= set(engine.runner.mtp._rows)
        engine.abort(second)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.runner.mtp._rows == {}  # released with the idle engine's last step


def test_a_head_of_two_layers_is_a_clear_error(tmp_path):
    import json

    write_mtp_checkpoint("qwen3.5", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="MTP head of 2 layers is not supported"):
        LLM(str(tmp_path), speculative_config=_mtp(1), **ENGINE)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_head_pass_that_fails_is_a_step_error_and_the_requests_go_on(family_checkpoint, async_scheduling):
    """The head's catch-up raising fails as a launch does: a StepError naming the requests it ran for, the step
    launched ahead (async) back to waiting; stepping on gives the ids of a run without speculation."""
    from pagellm.engine_errors import StepError

    path, _ = family_checkpoint
    plain, _ = _run(path, PROMPTS[:2], _greedy(12), async_scheduling=async_scheduling)
    with LLM(str(path), speculative_config=_mtp(2), async_scheduling=async_scheduling, **ENGINE) as llm:
        engine, drafter = llm.engine, llm.engine.runner.mtp
        ids = [engine.add_request(p, _greedy(12), request_id=f"r{i}") for i, p in enumerate(PROMPTS[:2])]
        run, calls = drafter._run, []

        def failing(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the head failed")
            return run(*args)

        drafter._run = failing
        outputs: dict[str, list[int]] = {}
        failures = []
        while engine.has_unfinished_requests():
            try:
                for out in engine.step():
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            except StepError as error:
                failures.append(error)
        assert len(failures) == 1 and set(failures[0].request_ids) == set(ids)
        assert [outputs[i] for i in ids] == plain
