"""The KV budget (runner/kv_budget.py): from device memory under gpu_memory_utilization, and the start-up check
that the pool holds one max-length sequence. The device's memory is read through DeviceMemory, which these
tests feed with figures; the profiling forward runs for real, on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig
from pagellm.platform import GIB
from pagellm.runner import kv_budget
from pagellm.runner.kv_budget import DeviceMemory, check_holds_one_sequence, kv_budget_bytes
from pagellm.runner.model_runner import kv_cache_bytes_per_block, state_bytes_per_slot
from tests.models.tiny_checkpoints import write_hybrid_checkpoint, write_tiny_checkpoint

# An 80 GiB device, 79 free at start; after loading and profiling torch peaked at 20 GiB and holds 21, and the
# device lost 22 GiB: 1 GiB outside torch (the CUDA context, cuBLAS workspaces).
BEFORE = DeviceMemory(total=80 * GIB, free=79 * GIB, allocated=0, peak=0, reserved=0)
AFTER = DeviceMemory(total=80 * GIB, free=57 * GIB, allocated=16 * GIB, peak=20 * GIB, reserved=21 * GIB)


def test_budget_is_the_fraction_less_peak_other_allocations_and_states():
    assert kv_budget_bytes(0.9, BEFORE, AFTER, 0) == int(0.9 * 80 * GIB) - 20 * GIB - GIB
    assert kv_budget_bytes(0.9, BEFORE, AFTER, 2 * GIB) == int(0.9 * 80 * GIB) - 23 * GIB
    assert kv_budget_bytes(0.5, BEFORE, AFTER, 0) == 40 * GIB - 21 * GIB


def test_a_fraction_the_device_cannot_give_or_that_leaves_nothing_is_an_error():
    crowded = DeviceMemory(total=80 * GIB, free=30 * GIB, allocated=0, peak=0, reserved=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.9 asks for 72.00 GiB .* only 30.00 GiB are free"):
        kv_budget_bytes(0.9, crowded, AFTER, 0)
    with pytest.raises(ValueError, match=r"0.25 \(20.00 GiB\) leaves no KV cache: .* peak at 20.00 GiB, other "
                                         r"allocations 1.00 GiB"):
        kv_budget_bytes(0.25, BEFORE, AFTER, 0)


def test_a_pool_shorter_than_one_max_length_sequence_is_an_error():
    check_holds_one_sequence(8, 16, 128, 1024, "kv_cache_memory")  # exactly one sequence: fine
    with pytest.raises(ValueError, match=r"holds 7 blocks of 16 tokens \(112 tokens, .* max_model_len 128 needs 8 "
                                         r".*raise kv_cache_memory or lower max_model_len"):
        check_holds_one_sequence(7, 16, 128, 1024, "kv_cache_memory")


@pytest.mark.parametrize("value", [0.0, -0.5, 1.01])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=value)


def test_a_pool_shorter_than_the_context_shortens_it_or_refuses_an_explicit_length(tmp_path, caplog):
    """The model's own context (256 here) is shortened to what the pool holds, said once with the setting to
    raise; a max_model_len the user asked for is refused at start instead, with the figures."""
    write_tiny_checkpoint("llama", tmp_path)  # max_position_embeddings 256
    with caplog.at_level(logging.WARNING, logger="pagellm.engine"):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=1e-5)  # 2 blocks of 16
    assert llm.engine.max_model_len == 32 and llm.engine.scheduler.max_model_len == 32
    assert "max_model_len 256 (the model's context) shortened to 32" in caplog.text and "kv_cache_memory" in caplog.text
    with pytest.raises(ValueError, match="prompt is 40 tokens, longer than the 31 tokens this engine can hold"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len 48 needs 3 .* raise kv_cache_memory or lower max_model_len"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=1e-5, max_model_len=48)


@pytest.mark.parametrize("family", ["llama", "qwen3-next"])
def test_sizing_from_device_memory_profiles_a_full_step_then_sizes_the_pool(family, tmp_path, monkeypatch, caplog):
    """The engine's device branch, run on the CPU with the device's figures given: the profiling forward of the
    largest step runs (a hybrid model's state too), the pool is what the budget leaves after other allocations
    and the state slots (and the sampler's buffers), the backend line says so, and the engine then runs on the
    pool the runner binds."""
    writer = write_tiny_checkpoint if family == "llama" else write_hybrid_checkpoint
    writer(family, tmp_path)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_batched_tokens=96,
              max_num_seqs=4, dtype="float32", gpu_memory_utilization=0.75)
    engine = llm.engine
    profiled = []
    real_profile = kv_budget.profile_forward
    monkeypatch.setattr("pagellm.runner.kv_budget.profile_forward",
                        lambda *args: profiled.append(args[2:4]) or real_profile(*args))
    # a 4 GiB device: 3 GiB allowed, 0.5 GiB taken outside torch since the start
    monkeypatch.setattr("pagellm.engine.DeviceMemory.read",
                        lambda device: DeviceMemory(total=4 * GIB, free=7 * GIB // 2, allocated=0, peak=0, reserved=0))
    with caplog.at_level(logging.INFO, logger="pagellm.engine"):
        blocks = engine._kv_blocks(DeviceMemory(total=4 * GIB, free=4 * GIB, allocated=0, peak=0, reserved=0), None)
    assert profiled == [(96, 4)]  # the largest step: max_num_batched_tokens tokens, max_num_seqs logits rows
    per_slot = state_bytes_per_slot(engine.model)
    states = 0 if per_slot == 0 else 4 * per_slot + GIB  # max_num_seqs slots + the snapshots' 1 GiB default
    states += 4 * engine.hf_config.vocab_size * kv_budget.SAMPLER_BYTES_PER_LOGIT  # the sampler's sort buffers
    assert (per_slot > 0) == (family == "qwen3-next")
    assert blocks == (5 * GIB // 2 - states) // kv_cache_bytes_per_block(engine.model, 16, torch.float32)
    assert f"KV {blocks * kv_cache_bytes_per_block(engine.model, 16, torch.float32) / GIB:.2f} GiB: {blocks} " \
           "blocks of 16 tokens" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4  # the profiling's scratch caches were replaced by the runner's
