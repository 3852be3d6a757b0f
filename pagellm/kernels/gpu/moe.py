"""MoE on CUDA in Triton: the router's top-k in one launch (`route`), and a layer's experts kept as GGUF planes
(layers/gguf_moe.GGUFPlanesExperts) in two grouped launches.

vLLM's fused MoE, on GGUF blocks: the (token, expert) pairs are sorted by expert into blocks of BM rows (each
expert's pairs padded to whole blocks), then one launch multiplies every block by its expert's gate/up planes
(weights dequantized in tiles, as kernels/gpu/gguf_matmul.py's tile kernel does), act * up runs once over all
pairs, and one launch multiplies by the experts' down planes with each pair's routing weight in the epilogue. No
step reads the counts on the host, and every shape follows from (tokens, k, experts): a decode step that calls
this can be captured. Each active expert's weights are read once per launch.

Import only where Triton kernels are wanted (kernels/gpu/layer_ops.py says why).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagellm.kernels.gpu.gguf_tiles import dot_step, tile
from pagellm.kernels.reference.gguf_planes import FORMATS, RUNS

BLOCK_M = 16  # pairs a block holds: tl.dot's smallest
TILE = (64, 64)  # BN, BH
# The tiles measured per MoE shape on a device (bench/device_moe_tiles.py writes entries in this file's format)
TILES_FILE = Path(__file__).with_name("moe_tiles.json")


class MoeTile(NamedTuple):
    """A MoE layer's launches: pairs a block holds (both launches share the alignment), and each launch's
    (BN, BH, warps) by the format of its planes (a format not named: TILE with 4 warps)."""

    block_m: int = BLOCK_M
    gate_up: dict = {}
    down: dict = {}

    def launch(self, which: str, ggml_type) -> tuple[int, int, int]:
        return tuple(getattr(self, which).get(ggml_type.name, (*TILE, 4)))


DEFAULT_TILE = MoeTile()


@functools.cache
def measured_tiles(path: Path = TILES_FILE) -> tuple[dict, ...]:
    """The file's entries: {"experts", "hidden", "intermediate", "tokens", "block_m", "gate_up": {format: [BN, BH,
    warps]}, "down": {...}}; none where there is no file."""
    if not path.exists():
        return ()
    return tuple(json.loads(path.read_text())["entries"])


def tile_for(experts: int, hidden: int, intermediate: int, tokens: int, entries=None) -> MoeTile:
    """The measured tile of this shape at the most tokens not above `tokens` (below every entry: the fewest);
    DEFAULT_TILE for a shape never measured. From shapes alone: a captured step replays what it chose."""
    entries = measured_tiles() if entries is None else entries
    shape = [e for e in entries if (e["experts"], e["hidden"], e["intermediate"]) == (experts, hidden, intermediate)]
    if not shape:
        return DEFAULT_TILE
    below = [e for e in shape if e["tokens"] <= tokens]
    entry = max(below, key=lambda e: e["tokens"]) if below else min(shape, key=lambda e: e["tokens"])
    return MoeTile(entry["block_m"], {k: tuple(v) for k, v in entry["gate_up"].items()},
                   {k: tuple(v) for k, v in entry["down"].items()})


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, X, s_logits, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One token: softmax over its X router logits in fp32, the k largest (ties: the lower expert id, as an
    ordered scan finds them), renormalised over the k when NORMALIZE, rounded to the logits' dtype."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    ok = e < X
    z = tl.load(logits_ptr + t * s_logits + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    slot = tl.arange(0, TOP_K)
    picked = tl.zeros([TOP_K], dtype=tl.float32)
    chosen = tl.zeros([TOP_K], dtype=tl.int64)
    left = tl.where(ok, p, -1.0)
    for i in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        which = tl.min(tl.where(left == best, e, BLOCK), axis=0)  # the lowest id among equal probabilities
        picked = tl.where(slot == i, best, picked)
        chosen = tl.where(slot == i, which.to(tl.int64), chosen)
        left = tl.where(e == which, -1.0, left)
    if NORMALIZE:
        picked = picked / tl.sum(picked, axis=0)
    tl.store(weights_ptr + t * TOP_K + slot, picked.to(weights_ptr.dtype.element_ty))
    tl.store(ids_ptr + t * TOP_K + slot, chosen)


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, X] logits -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64): layers/moe.route in one
    launch (torch's softmax, top-k, sum, divide and casts are five)."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
                                 NORMALIZE=normalize, BLOCK=triton.next_power_of_2(experts))
    return weights, ids


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [P + X (BM - 1)] int64: the pairs (t k + slot) grouped by expert, each expert's run
    padded to whole blocks of `block_m` with P; experts [blocks] int32: each block's expert, -1 past the last). On
    the device, in torch ops of static shapes (vLLM's moe_align_block_size, in one CUDA kernel there)."""
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [X]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [X] end row of each expert's run
    order = flat.argsort(stable=True)  # pairs by expert, token order kept within one
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # [X] where each expert's pairs start in `order`
    rank = torch.arange(pairs, device=ids.device) - first_of_expert[sorted_experts]
    rows = ends[sorted_experts] - padded[sorted_experts] + rank
    capacity = pairs + num_experts * (block_m - 1)
    aligned = torch.full((capacity,), pairs, dtype=torch.int64, device=ids.device)
    aligned[rows] = order
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    experts = torch.searchsorted(ends, starts, right=True).to(torch.int32)  # [blocks]
    experts = torch.where(experts < num_experts, experts, -1)
    return aligned, experts


@triton.jit
def _moe_planes_kernel(x_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, dm_ptr, e_qs, e_qh, e_sc, e_mn, e_d, e_dm,
                       pairs_ptr, experts_ptr, weights_ptr, out_ptr, P, N, K, TOP_K,
                       s_x, s_qs, s_qh, s_sc, s_mn, s_d, s_dm, s_out,
                       BY_TOKEN: tl.constexpr, WEIGHTED: tl.constexpr, FMT: tl.constexpr, RUN: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr):
    """One block of pairs (one expert) x BN output columns: out[pair] = x[row] W_e^T (x weight[pair])."""
    block, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(experts_ptr + block).to(tl.int64)
    if expert >= 0:
        pair = tl.load(pairs_ptr + block * BM + tl.arange(0, BM))
        live = pair < P
        if BY_TOKEN:
            row = pair // TOP_K  # gate/up read the pair's token
        else:
            row = pair  # down reads the pair's own act * up row
        cols = pid_n * BN + tl.arange(0, BN)
        n_ok = cols < N
        x_rows = x_ptr + row[:, None] * s_x
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, 2 * BH):
            w_lo, w_hi, c_lo, c_hi = tile(qs_ptr + expert * e_qs, qh_ptr + expert * e_qh, sc_ptr + expert * e_sc,
                                           mn_ptr + expert * e_mn, d_ptr + expert * e_d, dm_ptr + expert * e_dm,
                                           cols, n_ok, k0, K, s_qs, s_qh, s_sc, s_mn, s_d, s_dm, FMT, RUN, BH)
            acc = dot_step(acc, x_rows, live, w_lo, w_hi, c_lo, c_hi, K, BN, BH, PRECISION)
        dtype = out_ptr.dtype.element_ty
        if WEIGHTED:  # rounded to the model dtype first, then scaled in it, as HF's expert loop
            acc = acc.to(dtype).to(tl.float32) * tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)[
                :, None]
        tl.store(out_ptr + pair[:, None] * s_out + cols[None, :], acc.to(dtype), mask=live[:, None] & n_ok[None, :])


def grouped_planes_matmul(x: torch.Tensor, planes: tuple[torch.Tensor, ...], ggml_type, n: int, k: int,
                          aligned: torch.Tensor, experts: torch.Tensor, top_k: int,
                          weights: torch.Tensor | None = None, block_m: int = BLOCK_M,
                          tile: tuple[int, int, int] = (*TILE, 4)) -> torch.Tensor:
    """[P, n] = each pair's row of x (its token's when `weights` is None, else its own) times its expert's planes
    [X, n, ...] (scaled by the pair's routing weight where `weights` [P] is given); block_m: the alignment's, tile:
    (BN, BH, warps)."""
    pairs = x.shape[0] * top_k if weights is None else x.shape[0]
    out = torch.empty((pairs, n), dtype=x.dtype, device=x.device)
    bn, bh, warps = tile
    expert_strides = [t.stride(0) for t in planes]
    row_strides = [t.stride(1) if t.dim() == 3 else 0 for t in planes]
    _moe_planes_kernel[(experts.numel(), triton.cdiv(n, bn))](
        x, *planes, *expert_strides, aligned, experts, out if weights is None else weights, out, pairs, n, k, top_k,
        x.stride(0), *row_strides, out.stride(0), BY_TOKEN=weights is None, WEIGHTED=weights is not None,
        FMT=FORMATS.index(ggml_type), RUN=RUNS[ggml_type], BM=block_m, BN=bn, BH=bh,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)
    return out


def planes_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down, act_mul,
                   tile: MoeTile | None = None) -> torch.Tensor:
    """x [T, E], routing weights / ids [T, k] -> Σ_k w_k expert_k(x) [T, E]; gate_up, down: (planes [X, ...] x6,
    format, rows, cols) of the stacked experts; act_mul: [P, 2I] -> [P, I]; tile: the launches' (None: the measured
    one of this shape, tile_for)."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    num_experts = gate_up[0][0].shape[0]
    tile = tile or tile_for(num_experts, x.shape[1], down[3], tokens)
    aligned, experts = align_by_expert(ids, num_experts, tile.block_m)
    rows = x.contiguous()
    hidden = act_mul(grouped_planes_matmul(rows, *gate_up, aligned, experts, top_k, block_m=tile.block_m,
                                           tile=tile.launch("gate_up", gate_up[1]))).contiguous()  # [P, I]
    out = grouped_planes_matmul(hidden, *down, aligned, experts, top_k, weights.flatten().contiguous(),
                                block_m=tile.block_m, tile=tile.launch("down", down[1]))  # [P, E]
    return out.view(tokens, top_k, -1).sum(1)
