"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Legend: T = tokens in the step (B requests packed), E = hidden size, Hk / Hv =
key / value heads, dk / dv = their head dims, r = Hv / Hk, C = conv channels
= 2·Hk·dk + Hv·dv, K = conv kernel (4), S = state slots.

    x [T, E] -> q, k [T, Hk, dk], v [T, Hv, dv], z [T, Hv, dv], b, a [T, Hv]
    cat(q, k, v) -> causal depthwise conv1d over each request's tokens -> SiLU
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)       (fp32)
    gated delta rule per value head (kernels.gated_delta) in fp32, state [Hv, dk, dv]
    per-head RMSNorm over dv (weight w, not zero-centred), times silu(z); out_proj

Projections. Qwen3-Next fuses them, interleaved per key-head group:
in_proj_qkvz rows = Hk groups of [q dk | k dk | v r·dv | z r·dv], in_proj_ba rows =
Hk groups of [b r | a r]. Qwen3.5 has in_proj_qkv ([Q | K | V]), in_proj_z,
in_proj_b, in_proj_a. conv1d.weight is [C, 1, K] over channels [Q | K | V].

State lives outside the layer, one slot per request, bound by the runner
(`bind_state`, like PagedAttention.bind_kv_cache; sizes from `state_shapes`):
    conv_state      [S, C, K-1]     model dtype: the last K-1 pre-conv inputs
    recurrent_state [S, Hv, dk, dv] state_dtype: fp32 (default) or bf16 (CacheConfig.mamba_ssm_cache_dtype)
A bf16 state is read into fp32, the rule runs in fp32, and the state is rounded to bf16 when it is written back:
once per decode token, once per prefill chunk of a request, and at each snapshot, from which the chunk goes on (so
a request resumed from a snapshot, or a verify step's accepted drafts, continue as the request that wrote it).
Request b uses slot meta.state_slots[b]. Its context before the step is
seq_lens[b] - query_len[b]; 0 means a fresh request: it starts from zero state
and its slot is only written, never read.

Prefill: a device whose ops have a batched prefill (LayerOps.gated_delta_prefill: CUDA) runs every prefill request
of the step at once (layers/gated_delta_prefill.py); elsewhere one request at a time (`_sequence`).

Prefix caching (meta.snapshot_writes): the state after given block boundaries
of a chunk is copied into snapshot rows of the same tensors. The rule then runs
the chunk in pieces split at those boundaries (a piece's final state is the
boundary's state); the conv state there is the K-1 inputs before the boundary,
read from the conv window, which also holds the previous chunk's tail.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.gated_delta_prefill import packed_prefill
from pagellm.layers.kernel_user import KernelUser
from pagellm.layers.position_exact import sigmoid_any_position, softplus_any_position
from pagellm.kernels.reference.gated_delta import (chunked_gated_delta, gated_delta_step_, prepare_qk,
                                                   recurrent_gated_delta_)
from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.kernels.transfers import to_device

# Prefill runs the recurrent form below this many tokens and the chunked form
# (64-token chunks, the remainder as one shorter chunk) from it on. The recurrent step
# costs a few passes over a state that stays in cache per token; the chunked form has
# fixed work, then matmuls that use both cores: this is where it starts to win.
# measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
CHUNKED_MIN_TOKENS = 6


class StateShapes(NamedTuple):
    """Per-slot state of one layer: the runner allocates [num_slots, *shape] of each."""

    conv_state: tuple[int, int]  # (C, K-1)
    conv_dtype: torch.dtype  # the model dtype
    recurrent_state: tuple[int, int, int]  # (Hv, dk, dv)
    recurrent_dtype: torch.dtype  # float32 or bfloat16 (GatedDeltaNet.state_dtype)


def recurrent_state_dtype(setting: str, hf_config) -> torch.dtype:
    """CacheConfig.mamba_ssm_cache_dtype for a model: "auto" is the checkpoint's own mamba_ssm_dtype where its
    config names float32 or bfloat16 (Qwen3.5's names float32), else float32."""
    if setting == "auto":
        named = getattr(hf_config, "mamba_ssm_dtype", None)
        named = named or getattr(getattr(hf_config, "text_config", None), "mamba_ssm_dtype", None)
        setting = named if named in ("float32", "bfloat16") else "float32"
    if setting not in ("float32", "bfloat16"):
        raise ValueError(f"mamba_ssm_cache_dtype must be auto, float32 or bfloat16, got {setting!r}")
    return getattr(torch, setting)


class GatedRMSNorm(KernelUser, nn.Module):
    """y = (w * x / rms(x)) * silu(z) per value head, as HF's Qwen3NextRMSNormGated (norm before gate); one
    launch where the device's table has the fused kernel (CUDA) and the dtypes agree, else the torch below."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., dv] each
        fused = self.ops.gated_rms_norm
        if fused is not None and x.dtype == gate.dtype == self.weight.dtype:
            return fused(x, gate, self.weight, self.eps)
        return self.reference(x, gate)

    def reference(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def _consecutive(slots: list[int]) -> bool:
    return all(b - a == 1 for a, b in zip(slots, slots[1:]))


class GatedDeltaNet(KernelUser, nn.Module):
    def __init__(self, config, fused_projections: bool):
        super().__init__()
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # C
        self.kernel_size = config.linear_conv_kernel_dim  # K
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet conv activation must be silu, got {config.hidden_act!r}")
        self.fused_projections = fused_projections
        if fused_projections:  # Qwen3-Next
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        else:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        # nn.Conv1d only for its HF parameter name/shape (conv1d.weight [C, 1, K]); we call F.conv1d ourselves.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        # a Qwen3.5 GGUF's out_proj takes value heads in the file's tiled order (loader/gguf_hybrid.OUT_PROJ_TILED)
        self.out_tiled = getattr(config, "linear_out_proj_tiled", False) and self.num_v_heads != self.num_k_heads
        self.conv_state: torch.Tensor | None = None  # [S, C, K-1]
        self.recurrent_state: torch.Tensor | None = None  # [S, Hv, dk, dv] state_dtype
        self.state_dtype = torch.float32  # set by the loader (recurrent_state_dtype) before the state is sized

    def state_shapes(self) -> StateShapes:
        return StateShapes((self.conv_dim, self.kernel_size - 1), self.conv1d.weight.dtype,
                           (self.num_v_heads, self.head_k_dim, self.head_v_dim), self.state_dtype)

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        shapes = self.state_shapes()
        got = (tuple(conv_state.shape[1:]), tuple(recurrent_state.shape[1:]))
        if got != (shapes.conv_state, shapes.recurrent_state):
            raise ValueError(f"state shapes {tuple(conv_state.shape)}, {tuple(recurrent_state.shape)} do not match "
                             f"[S, {shapes.conv_state}], [S, {shapes.recurrent_state}]")
        if recurrent_state.dtype != self.state_dtype:
            raise ValueError(f"recurrent_state must be {self.state_dtype}, got {recurrent_state.dtype}")
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    def copy_state(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole state rows (conv and recurrent), e.g. a prefix-cache snapshot into a request's slot."""
        for src, dst in zip(sources, targets):
            self.conv_state[dst].copy_(self.conv_state[src])
            self.recurrent_state[dst].copy_(self.recurrent_state[src])

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """h [T, E] -> mixed qkv [T, C] (pre-conv, channels [Q | K | V]), z [T, Hv, dv], b, a [T, Hv]."""
        num_tokens = h.shape[0]
        if not self.fused_projections:
            z = self.in_proj_z(h).view(num_tokens, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        r, dk, dv = self.num_v_heads // self.num_k_heads, self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(h).view(num_tokens, self.num_k_heads, 2 * dk + 2 * r * dv)  # per key-head group
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(h).view(num_tokens, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], dim=-1)
        z = z.reshape(num_tokens, self.num_v_heads, dv)
        return mixed, z, b.reshape(num_tokens, self.num_v_heads), a.reshape(num_tokens, self.num_v_heads)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, E] -> [T, E]
        if self.conv_state is None or self.recurrent_state is None:
            raise RuntimeError("GatedDeltaNet used before the runner bound its state (bind_state)")
        if meta.state_slots is None or meta.state_slots_host is None:
            raise ValueError("a hybrid model step needs AttentionMetadata.state_slots")
        mixed, z, b, a = self._project(h)
        beta = sigmoid_any_position(b)  # [T, Hv]
        g = -self.A_log.float().exp() * softplus_any_position(a.float() + self.dt_bias)  # [T, Hv] fp32, <= 0
        if meta.verify_slots is not None:  # a verify step of one shape for every request (a graph's)
            core = self._verify(mixed, g, beta, meta.verify_slots, meta.verify_rows)
            return self._project_out(self.norm(core, z))
        core = torch.empty(h.shape[0], self.num_v_heads, self.head_v_dim, dtype=h.dtype, device=h.device)
        starts, qlens, slots = meta.query_start_loc_host, meta.query_lens_host, meta.state_slots_host
        # Requests continuing with one token go through the batched, slot-indexed decode path;
        # everything else (fresh requests, prefill chunks) one request at a time.
        # (a padded row of a captured step, slot -1, is one too: the kernels that pad skip it)
        decode = [i for i, (n, total) in enumerate(zip(qlens, meta.seq_lens_host))
                  if n == 1 and (total > 1 or slots[i] < 0)]
        if len(decode) == h.shape[0]:  # pure decode: every row, slots straight from the metadata
            core[:] = self._decode(mixed, g, beta, list(slots), meta.state_slots)
        elif decode:
            rows = to_device([starts[i] for i in decode], torch.long, h.device)
            core[rows] = self._decode(mixed[rows], g[rows], beta[rows], [slots[i] for i in decode])
        writes = meta.snapshot_writes_by_request()  # {b: [(p, row), ...]}: prefix-cache snapshots
        if writes:
            for i in decode:  # one token can only end on its boundary: copy the updated slot
                for _, row in writes.get(i, ()):
                    self.copy_state([slots[i]], [row])
        prefill = [i for i in sorted(set(range(meta.num_seqs)) - set(decode)) if starts[i + 1] > starts[i]]
        if prefill and self.ops.gated_delta_prefill is not None:  # every prefill request at once (a GPU)
            rows, out = packed_prefill(self, mixed, g, beta, meta, prefill, writes)
            core[rows] = out
            prefill = []
        for i in prefill:
            lo, hi = starts[i], starts[i + 1]
            before = meta.seq_lens_host[i] - (hi - lo)  # context before the step; 0 = fresh
            pieces = [(p - before, row) for p, row in writes.get(i, ())]
            core[lo:hi] = self._sequence(mixed[lo:hi], g[lo:hi], beta[lo:hi], slots[i], before == 0, pieces)
        return self._project_out(self.norm(core, z))

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, Hv, dv], value heads in grouped order (head g r + j reads key head g) -> out_proj's [T, E]; the
        heads moved to tiled order (j Hk + g) first where out_proj's columns are a Qwen3.5 GGUF's."""
        if self.out_tiled:
            out = out.view(out.shape[0], self.num_k_heads, -1, self.head_v_dim).transpose(1, 2)  # [T, r, Hk, dv]
        return self.out_proj(out.reshape(out.shape[0], -1))

    def _verify(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
        """Every request's Q tokens at rows b Q + j (runner/verify_inputs.py) -> core output [T, Hv, dv]: token j
        of every request a decode step at the slots of slots[j] (-1: padding, which the kernels skip, so a padded
        token never advances a state), then the states copied to rows[j] (the drafts' rollback rows). Device
        tensors only: a graph captured here replays any verify step of its shape."""
        kernels = self.ops.gated_delta_decode
        if kernels is None or not kernels.skips_padding or kernels.copy_rows_ is None:
            raise RuntimeError("a hybrid verify step of one shape needs decode kernels that skip padded slots")
        q = slots.shape[0]
        core = torch.empty(mixed.shape[0], self.num_v_heads, self.head_v_dim, dtype=mixed.dtype, device=mixed.device)
        for j in range(q):
            core[j::q] = self._decode_at(mixed[j::q], g[j::q], beta[j::q], slots[j], kernels)
            kernels.copy_rows_(self.conv_state, self.recurrent_state, slots[j], rows[j])
        return core

    def split_heads(self, conv_out: torch.Tensor, per_key_head: bool = False) -> tuple[torch.Tensor, ...]:
        """[n, C] -> q, k [n, Hv, dk] fp32 (normalised, per value head; per_key_head: [n, Hk, dk], contiguous, for
        the kernels that map value head h to key head h // r themselves), v [n, Hv, dv] fp32."""
        n = conv_out.shape[0]
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        heads = self.num_k_heads if per_key_head else self.num_v_heads
        q, k = prepare_qk(q.view(n, self.num_k_heads, self.head_k_dim), k.view(n, self.num_k_heads, self.head_k_dim),
                          heads)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim).float()
        return (q.contiguous(), k.contiguous(), v.contiguous()) if per_key_head else (q, k, v)

    def _sequence(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int, fresh: bool,
                  snapshots=()) -> torch.Tensor:
        """One request's L tokens (prefill chunk): x [L, C] pre-conv -> core output [L, Hv, dv].

        snapshots: ascending (r, row) pairs: the state after the chunk's first r tokens is copied to `row`.
        """
        kernel = self.kernel_size
        conv_slot, state_slot = self.conv_state[slot], self.recurrent_state[slot]  # views into the bound state
        history = x.new_zeros(self.conv_dim, kernel - 1) if fresh else conv_slot.to(x.dtype)  # [C, K-1]
        window = torch.cat([history, x.t()], dim=1)  # [C, K-1+L]: a continuation sees its previous inputs
        weight = self.conv1d.weight
        conv_out = F.silu(F.conv1d(window[None].to(weight.dtype), weight, groups=self.conv_dim)[0])  # [C, L]
        conv_slot.copy_(window[:, -(kernel - 1):])
        for r, row in snapshots:
            self.conv_state[row].copy_(window[:, r : r + kernel - 1])  # window column j + K-1 is token j
        q, k, v = self.split_heads(conv_out.t().to(x.dtype))
        # the rule runs on an fp32 state: the slot's own view, or a bf16 slot's copy written back at the end
        work = state_slot if state_slot.dtype == torch.float32 else state_slot.float()
        if fresh:
            work.zero_()
        beta = beta.float()
        outs, lo = [], 0
        for hi, row in (*snapshots, (x.shape[0], None)):
            if hi > lo:
                outs.append(self._rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], work))
            if row is not None:
                self.recurrent_state[row].copy_(work)
                if work is not state_slot:  # on from the rounded snapshot, as a request resumed from it goes on
                    work.copy_(self.recurrent_state[row])
            lo = hi
        if work is not state_slot:
            state_slot.copy_(work)
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).to(x.dtype)

    @staticmethod
    def _rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over L tokens from `state` [Hv, dk, dv] (updated in place) -> [L, Hv, dv] fp32."""
        if q.shape[0] >= CHUNKED_MIN_TOKENS:
            out, final = chunked_gated_delta(q, k, v, g, beta, state)
            state.copy_(final)
            return out
        return recurrent_gated_delta_(q, k, v, g, beta, state)  # in place on the slot's view

    def _decode(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: list[int],
                slot_index: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B continuing requests: x [B, C] pre-conv -> core output [B, Hv, dv].

        The native kernel (CPU, fp32/bf16) reads and writes each request's slot in place by
        index, for any slots; otherwise the torch reference below.
        """
        kernels = self.ops.gated_delta_decode
        if kernels is None:  # the device has none (chosen by its backend): the torch reference
            return self._decode_torch(x, g, beta, slots, slot_index)
        return self._decode_native(x, g, beta, slots, slot_index, kernels)

    def _decode_native(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: list[int],
                       slot_index: torch.Tensor | None, kernels) -> torch.Tensor:
        """_decode through the device's decode kernels (`kernels`: a DeltaDecode; on a CPU
        kernels/cpu/csrc/gated_delta_decode.cpp, on CUDA kernels/gpu/gated_delta.py): no gather, no write-back.
        The step is checked before either kernel touches a state: a conv update with no rule update after it would
        shift the conv state alone."""
        kernels.check(self.conv_state, self.recurrent_state, x, self.conv1d.weight[:, 0], slots)
        usable = (slot_index is not None and slot_index.numel() == len(slots) and slot_index.dtype == torch.int64
                  and slot_index.device == x.device and slot_index.is_contiguous())
        index = slot_index if usable else to_device(slots, torch.long, x.device)
        return self._decode_at(x, g, beta, index, kernels)

    def _decode_at(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, index: torch.Tensor,
                   kernels) -> torch.Tensor:
        """One token of each row at the slots of `index` (a device tensor; negative: padding, where the kernels
        skip it) -> [B, Hv, dv]: the kernels' calls alone, nothing read from the host."""
        weight = self.conv1d.weight[:, 0]  # [C, K], contiguous (a view of [C, 1, K])
        conv_out = kernels.conv_(self.conv_state, index, x.contiguous(), weight)
        q, k, v = self.split_heads(conv_out, per_key_head=True)
        out = kernels.rule_(self.recurrent_state, index, q, k, v, g.float().contiguous(), beta.float().contiguous())
        return out.to(x.dtype)

    def _decode_torch(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: list[int],
                      slot_index: torch.Tensor | None = None) -> torch.Tensor:
        """The torch reference of _decode (and the path of a device without decode kernels).

        Copies: when the slots are consecutive (e.g. 3, 4, 5) the states are a view of
        the bound tensors and every update below is in place: nothing is copied. Otherwise
        torch can only read state[slots] by gathering, so the B states are gathered once
        (a [B, Hv, dk, dv] read the math needs anyway), updated in place in that buffer,
        and written back with a single index_copy_ into their slots; no other copy of the
        state is made. The conv state ([B, C, K-1], small) follows the same rule.
        """
        count = len(slots)
        view = slice(slots[0], slots[0] + count) if _consecutive(slots) else None
        index = None
        if view is None:
            index = slot_index if slot_index is not None else to_device(slots, torch.long, x.device)
        conv = self.conv_state[view] if view is not None else self.conv_state.index_select(0, index)  # [B, C, K-1]
        window = torch.cat([conv.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
        weight = self.conv1d.weight[:, 0]  # [C, K]
        conv_out = F.silu((window.float() * weight.float()).sum(-1).to(x.dtype))  # [B, C], rounded as conv1d
        if view is not None:
            conv.copy_(window[:, :, 1:])
        else:
            self.conv_state.index_copy_(0, index, window[:, :, 1:].to(self.conv_state.dtype))
        q, k, v = self.split_heads(conv_out)  # [B, Hv, d]
        held = self.recurrent_state[view] if view is not None else self.recurrent_state.index_select(0, index)
        state = held.float()  # the rule in fp32: held itself when it is (a view or the gathered copy)
        flat = state.view(count * self.num_v_heads, self.head_k_dim, self.head_v_dim)  # [B*Hv, dk, dv]
        out = gated_delta_step_(flat, q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(),
                                beta.float().flatten())
        if view is None:
            self.recurrent_state.index_copy_(0, index, state.to(held.dtype))
        elif state is not held:  # a bf16 view: rounded back into its slots
            held.copy_(state)
        return out.view(count, self.num_v_heads, self.head_v_dim).to(x.dtype)
