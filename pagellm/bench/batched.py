"""`pagellm bench batched`: llama-batched-bench on LLMEngine.

For every (PP, TG, B): B requests with random token-id prompts of PP tokens
(or one prompt shared by all B) are queued at once; the prefill phase lasts
until every request has its first token, the decode phase until every request
has TG more. As in llama-batched-bench, the prefill phase yields the logits of
the last prompt token and the decode phase then runs TG steps of B tokens, so
a sequence ends with PP + TG tokens in the KV cache (and TG + 1 sampled, the
last one never fed back).

    N_KV = B*(PP+TG)      (shared prompt: PP + B*TG, the KV the prompt needs once)
    S_PP = B*PP / T_PP    (shared prompt: PP / T_PP)
    S_TG = B*TG / T_TG
    T    = T_PP + T_TG,   S = N_KV / T

The engine is sized so that one step holds the whole prefill of a row (the two
phases then do not overlap), every sequence fits the KV pool at once, and the
prefix cache is emptied between rows so a row never reads another row's blocks.
What the prefix cache did within a row (shared prompt) is reported with it.

With a JSON schema (--json-schema), every second request's output is held to it, so the
cost of the grammar masks shows beside rows that have none; its output must run past TG.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

from pagellm.bench.report import Column
from pagellm.config import (CacheConfig, EngineConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            SpeculativeConfig)
from pagellm.engine import LLMEngine
from pagellm.sampling_params import SamplingParams, StructuredOutputs

COLUMNS = (
    Column("PP", "PP"), Column("TG", "TG"), Column("B", "B"), Column("N_KV", "N_KV"),
    Column("T_PP", "T_PP s", "{:.3f}"), Column("S_PP", "S_PP t/s", "{:.2f}"),
    Column("T_TG", "T_TG s", "{:.3f}"), Column("S_TG", "S_TG t/s", "{:.2f}"),
    Column("T", "T s", "{:.3f}"), Column("S", "S t/s", "{:.2f}"),
)
PREFIX_COLUMNS = (  # what the prefix cache actually did: printed with --shared-prompt
    Column("prefill_tokens_computed", "PP computed"), Column("prefix_cache_hit_tokens", "PP from cache"),
)
PROFILE_COLUMNS = (
    Column("B", "B"), Column("phase", "phase"), Column("steps", "steps"),
    Column("host_ms_per_step", "host ms", "{:.2f}"), Column("input_copy_ms_per_step", "copy ms", "{:.2f}"),
    Column("model_ms_per_step", "model ms", "{:.2f}"), Column("sample_ms_per_step", "sample ms", "{:.2f}"),
    Column("host_syncs_per_step", "syncs/step", "{:.2f}"),
    Column("step_reuse", "reuse hit/miss"), Column("decode_graph_replays", "graph replays"),
)


def batched_row(pp: int, tg: int, b: int, t_pp: float, t_tg: float, shared_prompt: bool = False) -> dict:
    """One llama-batched-bench row from the two measured phase times (seconds)."""
    n_kv = pp + b * tg if shared_prompt else b * (pp + tg)
    prompt_tokens = pp if shared_prompt else b * pp
    t = t_pp + t_tg
    return {"PP": pp, "TG": tg, "B": b, "N_KV": n_kv, "T_PP": t_pp, "S_PP": prompt_tokens / t_pp,
            "T_TG": t_tg, "S_TG": b * tg / t_tg, "T": t, "S": n_kv / t}


def build_engine(model: str | None, dtype: str | None, max_batch: int, max_prompt: int, max_new: int, *,
                 block_size: int = 16, kv_cache_memory: float | None = None, kv_cache_dtype: str = "auto",
                 quantization: str = "auto", mamba_ssm_cache_dtype: str = "auto",
                 state_snapshot_interval: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 parallel: ParallelConfig | None = None, cpu_isa: str | None = None,
                 with_tokenizer: bool = False, device: str = "cpu", load_format: str = "auto",
                 enforce_eager: bool | None = None, async_scheduling: bool | None = None,
                 speculative: SpeculativeConfig | None = None) -> LLMEngine:
    """An engine that holds `max_batch` sequences at once; no tokenizer (benches feed token ids) unless
    grammars need its vocabulary; its max_model_len is what the longest sequence needs, so a KV budget sized for
    the bench's sequences holds one)."""
    batched_tokens = max_num_batched_tokens or max(max_batch * max_prompt, 64)
    config = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, quantization=quantization, device=device,
                          load_format=load_format, max_model_len=max(max_prompt + max_new, 32) + 1,  # 32: warm_up's
                          enforce_eager=enforce_eager),
        cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                          enable_prefix_caching=enable_prefix_caching, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                          state_snapshot_interval=state_snapshot_interval),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=batched_tokens,
                                  n_ubatch=min(64, batched_tokens), async_scheduling=async_scheduling),
        parallel=parallel or ParallelConfig(),
        kernels=KernelConfig() if cpu_isa is None else KernelConfig(cpu_isa=cpu_isa),
        speculative=speculative,
    )
    engine = LLMEngine(config, skip_tokenizer_init=not with_tokenizer)
    check_capacity(engine, max_batch, max_prompt + max_new)
    return engine


def check_capacity(engine: LLMEngine, batch: int, seq_len: int) -> None:
    if seq_len + 1 > engine.max_model_len:
        raise ValueError(f"PP + TG + 1 = {seq_len + 1} exceeds the model's context of {engine.max_model_len}")
    block_size = engine.kv_cache.block_size
    needed = batch * -(-seq_len // block_size)
    have = engine.kv_cache.pool.num_blocks
    if needed > have:
        raise ValueError(f"{batch} sequences of {seq_len} tokens need {needed} KV blocks, the pool has {have}: "
                         f"raise --kv-cache-memory (now {engine.config.cache.kv_cache_memory or 'default'} GiB) "
                         f"to at least {needed / have * _budget_gib(engine):.2f}")


def _budget_gib(engine: LLMEngine) -> float:
    """The pool's size in GiB, however it was sized (given, the host's default, or from device memory)."""
    from pagellm.runner.model_runner import kv_cache_bytes_per_block

    per_block = kv_cache_bytes_per_block(engine.model, engine.kv_cache.block_size, engine.kv_cache_dtype)
    return engine.kv_cache.pool.num_blocks * per_block / (1 << 30)


def random_prompts(rng: random.Random, batch: int, length: int, vocab_size: int, shared: bool) -> list[list[int]]:
    if shared:
        prompt = [rng.randrange(vocab_size) for _ in range(length)]
        return [prompt] * batch
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(batch)]


@dataclass
class PhaseTimes:
    t_pp: float
    t_tg: float
    stats_start: dict  # engine counters at the start, the end of prefill, and the end
    stats_prefill_end: dict
    stats_end: dict


def run_phases(engine: LLMEngine, prompts: list[list[int]], tg: int,
               structured: StructuredOutputs | None = None) -> PhaseTimes:
    """Queue all prompts, step until each has its first token (prefill), then until each has TG more.
    `structured`: the grammar every second request is held to."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the bench needs an idle engine")
    params = SamplingParams(max_tokens=tg + 1, temperature=0.0, ignore_eos=True)
    held = SamplingParams(max_tokens=tg + 1, temperature=0.0, structured_outputs=structured) if structured else None
    ids = {engine.add_request(p, held if held and i % 2 else params) for i, p in enumerate(prompts)}
    started: set[str] = set()
    counts: dict[str, int] = {}
    stats_start = dataclasses.asdict(engine.counters)
    t0 = time.perf_counter()
    t_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.add(out.request_id)
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if t_first is None and len(started) == len(ids):
            t_first = time.perf_counter()
            stats_prefill_end = dataclasses.asdict(engine.counters)
    t_end = time.perf_counter()
    if set(counts) != ids or set(counts.values()) != {tg + 1}:
        got = sorted(set(counts.values()))
        hint = "; the JSON schema's output ended first: give one whose output is longer" if structured else ""
        raise RuntimeError(f"expected {tg + 1} tokens from each of {len(ids)} requests, got {got}{hint}")
    return PhaseTimes(t_first - t0, t_end - t_first, stats_start, stats_prefill_end,
                      dataclasses.asdict(engine.counters))


def timed_run(engine: LLMEngine, prompts: list[list[int]], tg: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one run of `prompts`, as a peer's run reports them (bench compare,
    device-check); the prefix cache is reset first, so no run reads another's blocks."""
    engine.reset_prefix_cache()
    times = run_phases(engine, prompts, tg)
    return times.t_pp, times.t_tg


def step_profile(before: dict, after: dict) -> dict:
    """Per-step instrumentation between two snapshots of EngineStats."""
    steps = after["num_steps"] - before["num_steps"]
    per = max(steps, 1)
    diff = {k: after[k] - before[k] for k in after}
    hits, misses = diff["step_reuse_hits"], diff["step_reuse_misses"]
    return {
        "steps": steps,
        "host_ms_per_step": diff["host_ms_total"] / per,
        "input_copy_ms_per_step": diff["input_copy_ms_total"] / per,
        "model_ms_per_step": diff["model_ms_total"] / per,
        "sample_ms_per_step": diff["sample_ms_total"] / per,
        "host_syncs_per_step": diff["host_syncs_total"] / per,
        "step_reuse": f"{hits}/{misses}",
        "decode_graph_replays": diff["decode_graph_replays"],
        "prefill_tokens_computed": diff["computed_prefill_tokens"],
        "prefix_cache_hit_tokens": diff["prefix_cache_hit_tokens"],
    }


def measure(engine: LLMEngine, pp: int, tg: int, b: int, shared_prompt: bool, rng: random.Random,
            structured: StructuredOutputs | None = None):
    """One row: the llama-batched-bench figures and the per-phase step instrumentation."""
    engine.reset_prefix_cache()
    prompts = random_prompts(rng, b, pp, engine.hf_config.vocab_size, shared_prompt)
    times = run_phases(engine, prompts, tg, structured)
    prefill = step_profile(times.stats_start, times.stats_prefill_end)
    decode = step_profile(times.stats_prefill_end, times.stats_end)
    row = batched_row(pp, tg, b, times.t_pp, times.t_tg, shared_prompt)
    row["shared_prompt"] = shared_prompt
    row["prefill_tokens_computed"] = prefill["prefill_tokens_computed"]
    row["prefix_cache_hit_tokens"] = prefill["prefix_cache_hit_tokens"]
    profiles = [{"B": b, "phase": "prefill", **prefill}, {"B": b, "phase": "decode", **decode}]
    return row, profiles


def warm_up(engine: LLMEngine, rng: random.Random) -> None:
    """One short run first, so allocator and kernel start-up costs land outside the first row."""
    run_phases(engine, random_prompts(rng, 1, 16, engine.hf_config.vocab_size, False), 2)
    engine.reset_prefix_cache()


def run_sweep(engine: LLMEngine, pp_list, tg_list, npl, shared_prompt: bool = False, seed: int = 0,
              on_row=None, structured: StructuredOutputs | None = None):
    """All rows in llama-batched-bench order (PP, then TG, then B); `on_row(row)` is called as each ends."""
    rng = random.Random(seed)
    warm_up(engine, rng)
    rows, profiles = [], []
    for pp in pp_list:
        for tg in tg_list:
            for b in npl:
                row, prof = measure(engine, pp, tg, b, shared_prompt, rng, structured)
                rows.append(row)
                profiles += prof
                if on_row is not None:
                    on_row(row)
    return rows, profiles
