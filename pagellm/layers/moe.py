"""Sparse mixture-of-experts block (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE).

Legend: T = tokens in the step, E = hidden size, X = number of experts,
k = experts per token, I = expert (moe) intermediate size.

Router: logits = x W_gᵀ in the model dtype, softmax in fp32, top-k, renormalised
over the k picks iff `normalize` (the config's norm_topk_prob; Qwen3.5-MoE always
renormalises), then cast back to the model dtype, exactly as HF does.

Experts are stored stacked, as HF 5.x holds them in memory: `experts.gate_up_proj`
[X, 2I, E] (gate rows first) and `experts.down_proj` [X, E, I]. Checkpoints
(HF 5.x save_pretrained and the released Qwen checkpoints alike) store them per
expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`; `stack_expert_weights`
converts that stream at load time. A checkpoint that already holds the stacked
names loads by plain name match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.reference.layer_ops import ACTIVATION_FUNCTIONS
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.position_exact import sigmoid_any_position

# Dispatch (the device's, kernels/ops.py moe_path): on a CPU per-token for a single token
# (PER_TOKEN_MAX_TOKENS), grouped otherwise. Everything is bound by reading expert weights. At one token
# the paths read the same k experts and tie (per-token skips the sort); with more, per-token re-reads an
# expert for every token routed to it and loses badly, while the grouped forms read each active expert
# once. torch._grouped_mm (one call, no host sync for counts) matches or beats the Python loop, clearly
# in bf16, so it is used when present (it is a private API: the loop stays as the fallback). measured:
# docs/benchmarks/2026-11-24-quantized-layer-crossovers.md. On CUDA the grouped call serves one token
# too; that path has not run on a GPU yet. Experts kept in GGUF blocks on a CPU take neither: one kernel call
# runs each active expert once over its tokens (layers/gguf_moe.py), these paths being its fallback.


EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, X] logits -> (weights [T, k] in the logits dtype, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, X]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class MoeExperts(KernelUser, nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        if activation not in ACTIVATION_FUNCTIONS:
            raise ValueError(f"unsupported expert activation {activation!r}; supported: {sorted(ACTIVATION_FUNCTIONS)}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)  # [X, 2I, E]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                      requires_grad=False)  # [X, E, I]
        self.activation = activation

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:  # [n, E] -> [n, E] through expert e
        return F.linear(self.act_mul()(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])

    def act_mul(self):
        """gate_up -> act(gate) * up, as this device runs it for the experts' activation."""
        return self.bound("act_mul", lambda: self.ops.gated_act(self.activation))

    def dispatch(self, x: torch.Tensor) -> str:
        """Which path runs this batch: the device's choice (see the measurements above)."""
        return self.ops.moe_path(x.shape[0], x.dtype, self.hidden_size, self.intermediate_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                first_expert: int | None = None) -> torch.Tensor:
        """x [T, E], routing weights / ids [T, k] -> Σ_k w_k · expert_k(x)  [T, E].

        `first_expert` (expert parallel): this module holds experts [first, first + X) of a larger
        set; (token, expert) pairs routed elsewhere are skipped (their rank adds them).
        """
        if first_expert is not None:
            ids = ids - first_expert  # local ids; out of [0, X) means another rank's expert
        path = self.dispatch(x)
        if path == "per_token":
            return self._per_token(x, weights, ids)
        return self._grouped(x, weights, ids, use_grouped_mm=path == "grouped_mm",
                             filter_pairs=first_expert is not None)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 use_grouped_mm: bool = False, filter_pairs: bool = False) -> torch.Tensor:
        """Sort the (token, expert) pairs by expert; each active expert runs once over all its tokens."""
        top_k = ids.shape[1]
        flat_ids = ids.flatten()  # [T*k]
        pairs = torch.arange(flat_ids.numel(), device=x.device)  # [P] pair index = token * k + slot
        if filter_pairs:  # only pairs routed to the experts held here (one host sync for the count)
            pairs = ((flat_ids >= 0) & (flat_ids < self.num_experts)).nonzero().squeeze(1)
            flat_ids = flat_ids[pairs]
            if flat_ids.numel() == 0:
                return torch.zeros_like(x)
        order = flat_ids.argsort(stable=True)  # pairs grouped by expert, token order kept inside a group
        pairs = pairs[order]
        token_of = pairs // top_k  # [P] token row of each sorted pair
        counts = torch.bincount(flat_ids, minlength=self.num_experts)  # [X] pairs per expert
        rows = x[token_of]  # [P, E] gathered inputs, grouped by expert
        out_rows = self._grouped_mm(rows, counts) if use_grouped_mm else self._grouped_loop(rows, counts.tolist())
        out_rows *= weights.flatten()[pairs, None]
        # index_add_ walks the pairs in expert order, so each token sums its experts in
        # ascending expert id, the order HF's eager loop uses.
        return torch.zeros_like(x).index_add_(0, token_of, out_rows)

    def _grouped_loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:  # inactive experts are skipped: their weights are never read
                out_rows[start : start + n] = self.expert(rows[start : start + n], e)
                start += n
        return out_rows

    def _grouped_mm(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """All groups in one call: group e is rows offs[e-1]:offs[e] times expert e's weights."""
        offs = counts.cumsum(0).to(torch.int32)  # [X] end row of each group
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offs)  # [n, 2I]
        return torch._grouped_mm(self.act_mul()(gate_up).contiguous(),
                                 self.down_proj.transpose(1, 2), offs=offs)

    def _per_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t, (token_ids, token_weights) in enumerate(zip(ids.tolist(), weights)):
            for e in sorted(range(len(token_ids)), key=token_ids.__getitem__):  # ascending expert id, as HF
                if not 0 <= token_ids[e] < self.num_experts:
                    continue  # expert parallel: held by another rank
                out[t] += self.expert(x[t : t + 1], token_ids[e])[0] * token_weights[e]
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts, plus (Qwen3-Next, Qwen3.5-MoE) a shared expert scaled by sigmoid(x · w_sg)."""

    # fp32 on a CPU through a kernel whose rows do not depend on the batch (layers/dense.py): a token's routing
    # and gate the same alone, in a chunk, or in a verify step
    row_exact_linears = ("gate", "shared_expert_gate")

    def __init__(self, config, *, normalize: bool, shared_expert: bool):
        super().__init__()
        hidden = config.hidden_size
        self.top_k, self.normalize = config.num_experts_per_tok, normalize
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)  # router, [X, E]
        self.experts = MoeExperts(config.num_experts, hidden, config.moe_intermediate_size, config.hidden_act)
        self.has_shared_expert = shared_expert
        if shared_expert:
            self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, config.hidden_act)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.first_expert: int | None = None  # expert parallel: global id of experts[0] (distributed/sharding.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        routed = self.experts.ops.moe_route or route  # the device's fused top-k, else torch's
        weights, ids = routed(self.gate(x), self.top_k, self.normalize)  # [T, k] each
        out = self.experts(x, weights, ids, self.first_expert)
        if self.has_shared_expert:
            out = out + sigmoid_any_position(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] gate
        return out


class _ExpertStack:
    """One layer's stacked expert tensors, filled in place as per-expert weights stream in."""

    def __init__(self, experts: MoeExperts, device: torch.device):
        dtype = experts.gate_up_proj.dtype
        self.experts = experts
        self.gate_up = torch.empty(experts.gate_up_proj.shape, dtype=dtype, device=device)
        self.down = torch.empty(experts.down_proj.shape, dtype=dtype, device=device)
        self.seen: dict[str, set[int]] = {"gate_proj": set(), "up_proj": set(), "down_proj": set()}

    def put(self, name: str, expert: int, proj: str, tensor: torch.Tensor) -> None:
        num, inter, hidden = self.experts.num_experts, self.experts.intermediate_size, self.experts.hidden_size
        if expert >= num or expert in self.seen[proj]:
            raise ValueError(f"unexpected weight {name!r}: expert {expert} out of range ({num}) or repeated")
        shape = (hidden, inter) if proj == "down_proj" else (inter, hidden)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model {shape}")
        if proj == "down_proj":
            self.down[expert].copy_(tensor)
        else:  # gate rows first, then up rows, as HF's fused gate_up_proj
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            self.gate_up[expert, rows].copy_(tensor)
        self.seen[proj].add(expert)

    def gate_up_done(self) -> bool:
        num = self.experts.num_experts
        return len(self.seen["gate_proj"]) == num and len(self.seen["up_proj"]) == num

    def down_done(self) -> bool:
        return len(self.seen["down_proj"]) == self.experts.num_experts


def stack_expert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn per-expert checkpoint keys into the stacked `experts.gate_up_proj` / `experts.down_proj`.

    Every other (name, tensor) passes through unchanged. Each stacked tensor is
    allocated once, in the parameter's dtype on `device`, filled expert by expert,
    and yielded as soon as complete, so no second copy of a layer's experts is
    held. Keys of experts the model lacks are left for the strict loader to reject.
    """
    modules = {name: m for name, m in model.named_modules() if isinstance(m, MoeExperts)}
    pending: dict[str, _ExpertStack] = {}
    for name, tensor in weights:
        match = EXPERT_KEY.match(name)
        if match is None or match["prefix"] not in modules:
            yield name, tensor
            continue
        prefix = match["prefix"]
        stack = pending.setdefault(prefix, _ExpertStack(modules[prefix], device))
        stack.put(name, int(match["expert"]), match["proj"], tensor)
        if stack.gate_up_done() and stack.gate_up is not None:
            yield f"{prefix}.gate_up_proj", stack.gate_up
            stack.gate_up = None
        if stack.down_done() and stack.down is not None:
            yield f"{prefix}.down_proj", stack.down
            stack.down = None
