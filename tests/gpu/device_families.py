"""Greedy ids of every tiny family on a device, pagellm's engine against HF generate, fp32 and bf16: the family
check of a GPU run (docs/benchmarks/2026-11-26-gpu-h200.md). fp32 ids must be identical; bf16 ids are reported
(where they first leave HF's fp32 ids), not judged.

    python -m tests.gpu.device_families cuda        (exit status 1 if an fp32 run differs or a family fails)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from tests.models.tiny_checkpoints import (HYBRID_CONFIGS, TINY_CONFIGS, write_hybrid_checkpoint,
                                           write_tiny_checkpoint)

PROMPTS = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 21, 40)]
N = 16


def main(device: str) -> int:
    failed = False
    for family in [*TINY_CONFIGS, *HYBRID_CONFIGS]:
        failed |= not check(family, device)
    return 1 if failed else 0


def check(family: str, device: str) -> bool:
    """Print one family's line; False if its fp32 ids differ from HF's or it fails."""
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if family in TINY_CONFIGS:
                hf = write_tiny_checkpoint(family, Path(tmp), redraw=True)
            else:
                hf = write_hybrid_checkpoint(family, Path(tmp))
            hf = hf.to(device).eval()
            want = []
            for prompt in PROMPTS:
                with torch.inference_mode():
                    out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=N, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
                want.append(out[0, len(prompt):].tolist())
            line = [family]
            for dtype in ("float32", "bfloat16"):
                llm = LLM(model=tmp, skip_tokenizer_init=True, block_size=16, device=device, dtype=dtype,
                          kv_cache_memory=0.05, enforce_eager=True, async_scheduling=False)
                outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                                    use_tqdm=False)
                got = [o.outputs[0].token_ids for o in outs]
                same = sum(g == w for g, w in zip(got, want))
                first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), N) for g, w in zip(got, want)]
                line.append(f"{dtype}: {same}/{len(want)} identical, first divergence {first}")
                del llm
                if dtype == "float32" and torch.device(device).type == "cuda":
                    line.append(graphs_line(tmp, device, got, family in TINY_CONFIGS))
            print(" | ".join(line), f"({time.perf_counter() - t:.1f}s)", flush=True)
            return passed(line, torch.device(device).type == "cuda")
        except Exception as e:  # noqa: BLE001 - one family's failure must not hide the others'
            print(family, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            return False


def passed(line: list[str], cuda: bool) -> bool:
    """A family's verdict from its line's parts: fp32 ids all HF's, and on CUDA a graphs part whose ids are all
    eager's (the bf16 part is reported, not judged)."""
    n = len(PROMPTS)
    fp32 = next(part for part in line if part.startswith("float32: "))
    graphs = [part for part in line if part.startswith("graphs")]
    return (fp32.startswith(f"float32: {n}/{n} ") and len(graphs) == (1 if cuda else 0)
            and all(f": {n}/{n} as eager" in part for part in graphs))


def graphs_line(model: str, device: str, eager: list[list[int]], recurrent_free: bool) -> str:
    """fp32 ids with the decode graphs captured (and async scheduling where the model allows it) against eager's:
    what the default step mode must give."""
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=16, device=device, dtype="float32",
              kv_cache_memory=0.05, enforce_eager=False, async_scheduling=recurrent_free)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    same = sum(o.outputs[0].token_ids == e for o, e in zip(outs, eager))
    return (f"graphs{'+async' if recurrent_free else ''}: {same}/{len(eager)} as eager, "
            f"{stats['decode_graph_replays']} replays ({stats['decode_graphs']})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
