"""The Gated DeltaNet's prefill rule on a device, three ways at a published shape's heads: issue 54's "decide by
measurement" between our Triton kernel and fla-core.

    triton      kernels/gpu/gated_delta_prefill.py: every request in one launch, states in place at their slots
                (and triton-v*: the same kernel with other tiles, for the default's choice)
    torch       the module's own path on a device without it: the reference's chunked rule a request at a time
    fla-core    fla-core's chunk_gated_delta_rule over the same packed tokens (cu_seqlens), the requests' states
                gathered from their slots before and scattered back after (it takes a dense batch of states);
                only where the package imports

Each case is N requests of L tokens, continuing from random states at shuffled slots. Each engine runs once to
warm up (Triton compiles), then `repeats` times, each timed alone with CUDA events (on a CPU, the rehearsal: wall
time). The numerics are each engine's largest difference from the torch path, in the outputs and final states,
beside the largest magnitude (fp32 throughout).

    pagellm bench device-check --device cuda --shapes "" --skip-checks --serve-prompts 0 \
        --delta-prefill-shape qwen3.5-35b-a3b
"""

from __future__ import annotations

import importlib
import statistics

import torch
import torch.nn.functional as F

from pagellm.bench.device_verify import timed_ms
from pagellm.bench.hybrid_shapes import HYBRID_SHAPES
from pagellm.kernels.reference.gated_delta import PrefillSequence, chunked_gated_delta

CASES = ((1, 4096), (8, 512), (64, 128), (128, 128))  # (requests, tokens each): one long prompt to many short
REHEARSAL_CASES = ((1, 70), (3, 20))  # a CPU's, under Triton's interpreter


def prefill_costs(shape: str, device: str, cases=None, repeats: int = 5, keep=None) -> dict:
    """{"rows": [{engine, shape, requests, tokens, ms, tokens_per_s}], "numerics": {engine: {...}}, "errors": {...},
    ...}; keep(result) after every row (a run cut short keeps what it measured)."""
    fields = HYBRID_SHAPES[shape]
    heads = (fields["linear_num_key_heads"], fields["linear_num_value_heads"], fields["linear_key_head_dim"],
             fields["linear_value_head_dim"])
    engines = _engines()
    cases = cases or (CASES if device.startswith("cuda") else REHEARSAL_CASES)
    result = {"shape": shape, "heads": dict(zip(("Hk", "Hv", "dk", "dv"), heads)), "engines": sorted(engines),
              "rows": [], "numerics": {}, "errors": {}}
    for requests, tokens in cases:
        case = _case(requests, tokens, heads, torch.device(device), seed=requests)
        outputs = {}
        for name, engine in engines.items():
            try:
                outputs[name], ms = _timed(engine, case, torch.device(device), repeats)
            except Exception as e:  # noqa: BLE001 - one engine's failure (a tile that does not build) spares the rest
                result["errors"][f"{name} N={requests} L={tokens}"] = f"{type(e).__name__}: {e}"
                continue
            result["rows"].append({"engine": name, "shape": shape, "requests": requests, "tokens": tokens,
                                   "ms": round(ms, 3), "tokens_per_s": round(requests * tokens / ms * 1e3, 1)})
            print(f"delta prefill {name:26} N={requests:4} L={tokens:5}: {ms:9.3f} ms", flush=True)
            if keep is not None:
                keep(result)
        _add_numerics(result, outputs, case["slots"])
    return result


def _timed(engine, case: dict, device: torch.device, repeats: int) -> tuple[tuple, float]:
    """((the warm-up's output and final states: the numerics), the median of `repeats` timed runs in ms)."""
    state = case["state"].clone()
    first = engine(state, case), state
    times = []
    for _ in range(repeats):
        state = case["state"].clone()
        times.append(timed_ms(lambda: engine(state, case), device))
    return first, statistics.median(times)


def _add_numerics(result: dict, outputs: dict, slots: torch.Tensor) -> None:
    """Each engine's largest difference from torch's path so far, in outputs and the slots' final states."""
    if "torch" not in outputs:
        return
    want_out, want_state = outputs["torch"]
    for name, (out, state) in outputs.items():
        worst = result["numerics"].setdefault(name, {"out": 0.0, "state": 0.0})
        worst["out"] = max(worst["out"], (out - want_out).abs().max().item())
        worst["state"] = max(worst["state"], (state[slots] - want_state[slots]).abs().max().item())
    result["numerics"]["magnitude"] = max(result["numerics"].get("magnitude", 0.0), want_out.abs().max().item())


def _case(requests: int, tokens: int, heads: tuple[int, int, int, int], device: torch.device, seed: int) -> dict:
    k_heads, v_heads, dk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    total = requests * tokens
    q = F.normalize(torch.randn(total, k_heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(total, k_heads, dk, generator=gen), dim=-1)
    v = torch.randn(total, v_heads, dv, generator=gen)
    g = -torch.rand(total, v_heads, generator=gen) * 0.1
    beta = torch.rand(total, v_heads, generator=gen)
    slots = torch.randperm(requests + 1, generator=gen)[:requests]  # one spare slot: not every row is a request's
    state = torch.randn(requests + 1, v_heads, dk, dv, generator=gen) * 0.1
    sequences = [PrefillSequence(i * tokens, tokens, int(slot), False) for i, slot in enumerate(slots)]
    tensors = {name: t.to(device) for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, state=state).items()}
    return {**tensors, "slots": slots.to(device), "sequences": sequences,
            "cu_seqlens": torch.arange(0, total + 1, tokens, device=device)}


# the Triton launch's other tiles timed beside its default: (value columns a program, dot precision, warps)
TRITON_VARIANTS = ((64, "tf32x3", 4), (32, "tf32", 4), (32, "tf32x3", 8), (64, "tf32x3", 8))


def _engines() -> dict:
    """torch's, ours, fla-core's where it imports, then our other tiles: in that order, so a run cut short by its
    time limit has the three answers first."""
    engines = {"torch": _torch_rule, "triton": _triton_rule()}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - not installed, or no GPU driver for it: the others still answer
        chunk_gated_delta_rule = None
    if chunk_gated_delta_rule is not None:
        engines["fla-core"] = lambda state, case: _fla_rule(chunk_gated_delta_rule, state, case)
    for block_v, precision, warps in TRITON_VARIANTS:
        engines[f"triton-v{block_v}-{precision}-w{warps}"] = _triton_rule(block_v=block_v, precision=precision,
                                                                          num_warps=warps)
    return engines


def _triton_rule(**tile):
    kernel = importlib.import_module("pagellm.kernels.gpu.gated_delta_prefill").rule_prefill_
    return lambda state, case: kernel(state, case["q"], case["k"], case["v"], case["g"], case["beta"],
                                      case["sequences"], **tile)


def _torch_rule(state: torch.Tensor, case: dict) -> torch.Tensor:
    """A request at a time, as GatedDeltaNet._rule does for a prefill chunk."""
    repeat = case["v"].shape[1] // case["q"].shape[1]
    out = torch.empty_like(case["v"])
    for seq in case["sequences"]:
        span = slice(seq.start, seq.start + seq.length)
        q, k = (case[name][span].repeat_interleave(repeat, dim=1) for name in ("q", "k"))
        out[span], final = chunked_gated_delta(q, k, case["v"][span], case["g"][span], case["beta"][span],
                                               state[seq.slot])
        state[seq.slot].copy_(final)
    return out


def _fla_rule(chunk_gated_delta_rule, state: torch.Tensor, case: dict) -> torch.Tensor:
    """fla-core's chunked rule (q already normalised and scaled: scale 1), its value heads grouped over the key
    heads as ours (GVA), the states gathered and scattered by slot."""
    slots = case["slots"]
    out, final = chunk_gated_delta_rule(case["q"][None], case["k"][None], case["v"][None], case["g"][None],
                                        case["beta"][None], scale=1.0, initial_state=state[slots],
                                        output_final_state=True, cu_seqlens=case["cu_seqlens"])
    state.index_copy_(0, slots, final.float())
    return out[0].float()
