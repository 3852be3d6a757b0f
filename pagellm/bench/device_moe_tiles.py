"""The grouped MoE launches' tiles on a device (kernels/gpu/moe.py): at a MoE shape, for Q4_K_M's expert formats
(gate/up Q4_K; down Q4_K, or Q6_K in the layers that get more bits), every candidate tile timed per token count,
and the fastest written as entries of kernels/gpu/moe_tiles.json (issue 54: tile configs chosen per (experts,
N, M) on the device and kept as data).

Both launches of a layer share the pairs' alignment, so the block of pairs (BM) is chosen for the two together:
the one whose best gate/up plus best down (the mean over the down formats) is fastest; then each launch's
(BN, BH, warps) at that BM. Each expert's planes are one random expert's, repeated (the bytes read matter, not
the codes); the pairs are random distinct experts per token. Timed with CUDA events, median of 10 after a
warm-up (on a CPU, the rehearsal: wall time under Triton's interpreter, at dimensions rounded up to whole
super-blocks).

    pagellm bench device-check --device cuda --shapes "" --skip-checks --serve-prompts 0 \
        --moe-tiles-shape qwen3.5-35b-a3b --out tiles.json
"""

from __future__ import annotations

import importlib
import statistics

import numpy as np
import torch

from pagellm.bench.device_verify import timed_ms
from pagellm.bench.gguf_files import random_blocks
from pagellm.bench.hybrid_shapes import HYBRID_SHAPES
from pagellm.kernels.reference.gguf_planes import T
from pagellm.loader.gguf_planes import planes_of

TOKENS = (1, 8, 32, 128, 512)
BLOCKS_M = (16, 32, 64)
LAUNCH_TILES = ((64, 64, 4), (128, 64, 4), (64, 32, 4), (128, 32, 8), (64, 64, 8))  # (BN, BH, warps)
FORMATS = {"gate_up": (T.Q4_K,), "down": (T.Q4_K, T.Q6_K)}
REHEARSAL = dict(tokens=(1, 5), blocks_m=(16, 32), tiles=((64, 64, 4), (32, 32, 4)))  # a CPU's, interpreted


def sweep(shape: str, device: str, keep=None) -> dict:
    """{"rows": [one per timing], "entries": [moe_tiles.json's], "shape": ...}; keep(result) after each token
    count (a run cut short keeps what it measured)."""
    fields = HYBRID_SHAPES[shape]
    on_cuda = device.startswith("cuda")
    whole = 1 if on_cuda else 256  # the rehearsal's tiny dimensions rounded up to whole K-quant super-blocks
    experts, top_k = fields["num_experts"], fields["num_experts_per_tok"]
    hidden, inter = -(-fields["hidden_size"] // whole) * whole, -(-fields["moe_intermediate_size"] // whole) * whole
    tokens_list, blocks_m, tiles = (TOKENS, BLOCKS_M, LAUNCH_TILES) if on_cuda else REHEARSAL.values()
    moe = importlib.import_module("pagellm.kernels.gpu.moe")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    planes = {(launch, kind): _experts(kind, rows, cols, experts, device)
              for launch, rows, cols in (("gate_up", 2 * inter, hidden), ("down", hidden, inter))
              for kind in FORMATS[launch]}
    result = {"shape": shape, "experts": experts, "hidden": hidden, "intermediate": inter, "rows": [],
              "entries": []}
    generator = torch.Generator().manual_seed(0)
    for tokens in tokens_list:
        ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(device)
        inputs = {"gate_up": torch.randn(tokens, hidden, generator=generator).to(device, dtype),
                  "down": torch.randn(tokens * top_k, inter, generator=generator).to(device, dtype)}
        weights = torch.rand(tokens * top_k, generator=generator).to(device, dtype)
        best = {}  # (block_m, launch, format) -> (ms, tile)
        for block_m in blocks_m:
            aligned, block_experts = moe.align_by_expert(ids, experts, block_m)
            for (launch, kind), stacked in planes.items():
                rows, cols = (2 * inter, hidden) if launch == "gate_up" else (hidden, inter)
                for tile in tiles:
                    def run(tile=tile, launch=launch, kind=kind, stacked=stacked, rows=rows, cols=cols):
                        moe.grouped_planes_matmul(inputs[launch], stacked, kind, rows, cols, aligned, block_experts,
                                                  top_k, None if launch == "gate_up" else weights, block_m, tile)
                    ms = _median_ms(run, torch.device(device))
                    result["rows"].append({"tokens": tokens, "block_m": block_m, "launch": launch,
                                           "format": kind.name, "tile": list(tile), "ms": round(ms, 4)})
                    if (block_m, launch, kind) not in best or ms < best[block_m, launch, kind][0]:
                        best[block_m, launch, kind] = (ms, tile)
        result["entries"].append(_entry(best, blocks_m, tokens, experts, hidden, inter))
        if keep is not None:
            keep(result)
    return result


def _entry(best: dict, blocks_m, tokens: int, experts: int, hidden: int, inter: int) -> dict:
    """moe_tiles.json's entry for one token count: the block of pairs whose two launches are fastest together."""
    def total(block_m):
        down = [best[block_m, "down", kind][0] for kind in FORMATS["down"]]
        return sum(best[block_m, "gate_up", kind][0] for kind in FORMATS["gate_up"]) + statistics.mean(down)
    block_m = min(blocks_m, key=total)
    return {"experts": experts, "hidden": hidden, "intermediate": inter, "tokens": tokens, "block_m": block_m,
            **{launch: {kind.name: list(best[block_m, launch, kind][1]) for kind in kinds}
               for launch, kinds in FORMATS.items()},
            "ms": round(total(block_m), 4)}


def _experts(kind, rows: int, cols: int, experts: int, device: str) -> tuple[torch.Tensor, ...]:
    """One random expert's planes repeated for every expert: [X, ...] each."""
    one = planes_of(random_blocks(np.random.default_rng(rows + cols), kind, rows, cols), kind, (rows, cols))
    return tuple(t.to(device).unsqueeze(0).expand(experts, *t.shape).contiguous() for t in one.tensors())


def _median_ms(run, device: torch.device, repeats: int = 10) -> float:
    run()  # compiles
    return statistics.median(timed_ms(run, device) for _ in range(repeats if device.type == "cuda" else 1))
