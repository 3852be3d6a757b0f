"""`pagellm bench state-dtype`: what keeping a Gated DeltaNet's recurrent state in bf16
(CacheConfig.mamba_ssm_cache_dtype) instead of fp32 gains and costs, at a real head shape (Qwen3.5's: 16 key and
32 value heads of 128).

Speed: one decode step's rule over `--layers` layers' states through the CPU kernel at each instruction-set level
this host runs (kernels/cpu/csrc/gated_delta_decode.cpp), states of both dtypes alternated, B requests at scattered
slots of 2 B, so the states come from memory as a serving step's do.

Drift: the rule token by token as decode steps run it (kernels/reference/gated_delta.gated_delta_step_, which the
native and Triton kernels match): one state kept in fp32, one widened from bf16 and rounded back after each token,
the same inputs for both; the relative L2 error of the bf16 state's outputs at given tokens. Inputs are random
(unit q and k, v ~ N(0, 1), beta ~ U(0, 1)) and the decay e^g is held per row, since it sets how many roundings a
state's error is made of (a head keeping e^g of its past per token sums about 1 / (1 - e^g) of them). This bounds
the numerics at each timescale; a model's quality needs trained weights (its heads decay at many rates).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagellm.kernels.build import native
from pagellm.kernels.cpu import gated_delta_decode
from pagellm.kernels.reference.gated_delta import gated_delta_step_, prepare_qk

K_HEADS, V_HEADS, HEAD_DIM = 16, 32, 128  # Qwen3.5's Gated DeltaNet (35B-A3B; the 27B has 48 value heads)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rule_ms(level: str, dtype: torch.dtype, batch: int, layers: int, repeats: int) -> float:
    """Median milliseconds of one decode step's rule over `layers` layers (B requests each) at `level`."""
    gen = torch.Generator().manual_seed(batch)
    states = [(torch.randn(2 * batch, V_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1).to(dtype)
              for _ in range(layers)]
    slots = torch.arange(batch) * 2
    q, k = prepare_qk(torch.randn(batch, K_HEADS, HEAD_DIM, generator=gen),
                      torch.randn(batch, K_HEADS, HEAD_DIM, generator=gen), K_HEADS)
    v, g, beta = torch.randn(batch, V_HEADS, HEAD_DIM, generator=gen), -torch.rand(batch, V_HEADS), torch.rand(
        batch, V_HEADS)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        for state in states:
            gated_delta_decode.rule_decode_(state, slots, q, k, v, g, beta, level)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def drift(decay: float, tokens: int, checkpoints: list[int], seed: int = 0) -> dict:
    """{token: relative L2 error of the bf16 state's outputs there, over the heads} at one decay, and the state's
    own relative error at the end."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.zeros(V_HEADS, HEAD_DIM, HEAD_DIM)
    narrow = torch.zeros(V_HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.bfloat16)
    g = torch.full((V_HEADS,), float(torch.tensor(decay, dtype=torch.float64).log()))
    errors = {}
    for t in range(1, tokens + 1):
        q, k = prepare_qk(torch.randn(V_HEADS, HEAD_DIM, generator=gen), torch.randn(V_HEADS, HEAD_DIM, generator=gen),
                          V_HEADS)
        v, beta = torch.randn(V_HEADS, HEAD_DIM, generator=gen), torch.rand(V_HEADS, generator=gen)
        exact = gated_delta_step_(wide, q, k, v, g, beta)
        held = narrow.float()
        rounded = gated_delta_step_(held, q, k, v, g, beta)
        narrow.copy_(held)  # rounded to nearest even once a token, as the kernels store it
        if t in checkpoints:
            errors[t] = ((rounded - exact).norm() / exact.norm()).item()
    state_error = ((narrow.float() - wide).norm() / wide.norm()).item()
    return {"decay": decay, "output_error": errors, "state_error": state_error}


def check_arguments(args: argparse.Namespace) -> None:
    """A ValueError naming the first argument out of range."""
    for name in ("layers", "repeats", "rounds", "tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.decays or not all(0 < decay < 1 for decay in args.decays):
        raise ValueError(f"--decays must be in (0, 1), got {args.decays}")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    result = {"shape": f"{K_HEADS} key / {V_HEADS} value heads of {HEAD_DIM}", "layers": args.layers, "speed": [],
              "drift": []}
    print("| level | B | fp32 state ms/step | bf16 state ms/step | bf16 speed-up |\n|---|---|---|---|---|")
    for level in native.host_levels():
        for batch in args.npl:
            ms = {name: [] for name in DTYPES}
            for _ in range(args.rounds):  # the dtypes alternated
                for name, dtype in DTYPES.items():
                    ms[name].append(rule_ms(level, dtype, batch, args.layers, args.repeats))
            row = {"level": level, "B": batch, **{f"{name}_ms": statistics.median(v) for name, v in ms.items()}}
            result["speed"].append(row)
            print(f"| {level} | {batch} | {row['float32_ms']:.3f} | {row['bfloat16_ms']:.3f} | "
                  f"{row['float32_ms'] / row['bfloat16_ms']:.2f}x |", flush=True)
    checkpoints = sorted({t for t in (64, 512, 4096, 32768) if t <= args.tokens} | {args.tokens})
    print("\n| decay e^g | " + " | ".join(f"output error @{t}" for t in checkpoints) + " | state error |")
    print("|---" * (len(checkpoints) + 2) + "|")
    for decay in args.decays:
        row = drift(decay, args.tokens, checkpoints, args.seed)
        result["drift"].append(row)
        cells = " | ".join(f"{row['output_error'][t]:.2e}" for t in checkpoints)
        print(f"| {decay} | {cells} | {row['state_error']:.2e} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0
