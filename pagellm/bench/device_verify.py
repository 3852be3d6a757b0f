"""What a verify step of speculative decoding costs against a one-token decode step at B=1, each replayed from its
CUDA graph (runner/verify_inputs.py): issue 55's GPU figure, at a real shape with --load-format dummy.

Both steps run the bound forward over the runner's own persistent buffers, filled once for one request at
`context` tokens (its blocks the pool's first ones: the values are random weights' and do not matter, the bytes
read do), then replayed alternately, each timed alone with CUDA events (on a CPU, the rehearsal: wall time of
the same buffers run eagerly). The LM head and the sampler stay out: they run eagerly after either step, a row
per token.

    pagellm bench device-check --device cuda --shapes 8b --verify-shape 8b ...   (its `verify_cost` check)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pagellm.bench import batched
from pagellm.config import SpeculativeConfig
from pagellm.core.types import ScheduledRequest
from pagellm.runner.input_batch import SlotState
from pagellm.sampling_params import SamplingParams


def verify_cost(args: argparse.Namespace, config_dir: Path, drafts: int = 4, context: int = 512,
                repeats: int = 50) -> dict:
    """{decode_ms, verify_ms, ratio} of the model in config_dir (dummy weights), graphs and async on."""
    spec = SpeculativeConfig(num_speculative_tokens=drafts, adaptive=False)
    engine = batched.build_engine(str(config_dir), args.dtype, 1, context + drafts + 1, 1, device=args.device,
                                  load_format="dummy", kv_cache_memory=args.kv_cache_memory, speculative=spec)
    try:
        return step_costs(engine, drafts, context, repeats)
    finally:
        engine.shutdown()


def step_costs(engine, drafts: int, context: int, repeats: int) -> dict:
    """The two steps' median times over `repeats` alternating rounds (after one warm-up each)."""
    runner = engine.runner
    if runner.verify_graphs is None or runner.decode_graphs is None:
        return {"not_run": "no verify graphs: they need decode graphs and a speculative_config"}
    if runner.state_layers:
        return {"not_run": "a hybrid shape: this check gives its request no state slot (attention-only shapes)"}
    blocks = list(range(-(-(context + drafts + 1) // runner.block_size)))
    state = SlotState("cost", SamplingParams(), [0], [], block_ids=blocks)
    decode = ScheduledRequest("cost", 0, (1,), context, (), True)
    verify = ScheduledRequest("cost", 0, (1,) * (1 + drafts), context, (), True, num_draft=drafts)
    key = runner.verify_graphs.inputs.key_for((verify,))
    with torch.inference_mode():
        decode_inputs = runner.decode_inputs.prepare((decode,), [state])[:3]
        verify_inputs = runner.verify_graphs.inputs.prepare((verify,), [state], key)[:3]
        steps = {"decode": lambda: runner.decode_graphs.run(*decode_inputs),
                 "verify": lambda: runner.verify_graphs.run(*verify_inputs, key)}
        times = {name: [] for name in steps}
        for _ in range(repeats + 1):
            for name, run in steps.items():
                times[name].append(timed_ms(run, runner.device))
    decode_ms, verify_ms = (statistics.median(times[name][1:]) for name in ("decode", "verify"))
    return {"context": context, "drafts": drafts, "padded_to": key, "decode_ms": decode_ms, "verify_ms": verify_ms,
            "ratio": verify_ms / decode_ms, "replayed": runner.verify_graphs.replays > 0,
            "ok": verify_ms <= 1.25 * decode_ms}


def timed_ms(run, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
