"""Drive a pagellm model over a paged KV cache the way the runner does, for tests.

Blocks come from a shuffled free list, so a sequence's blocks are neither
contiguous nor in order: attention that ignored the block table would fail.

Hybrid models (`model.state_layers()`, Gated DeltaNet) also get recurrent-state
tensors, one slot per sequence name, slots drawn from a shuffled list too. The
state starts as NaN: a fresh sequence must never read its slot, only write it.
"""

from __future__ import annotations

import torch

from pagellm.kernels.attention_metadata import AttentionMetadata
from pagellm.config import KernelConfig
from pagellm.models.bound_layers import PlanSettings, activation_dtype, plan_model
from pagellm.runner.backend import device_kernels


class PagedHarness:
    def __init__(self, model, block_size: int = 4, num_blocks: int = 64, seed: int = 0, num_state_slots: int = 8,
                 kv_cache_dtype: torch.dtype | None = None, bound_layers: bool = True):
        """bound_layers: plan the layers as the runner does (bound where they can be), else run the modules."""
        self.model, self.block_size = model, block_size
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        for layer in model.attention_layers():  # K/V in the model's dtype unless told
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(torch.zeros(shape, dtype=kv_cache_dtype or self.dtype, device=self.device),
                                torch.zeros(shape, dtype=kv_cache_dtype or self.dtype, device=self.device))
        self.has_state = bool(getattr(model, "state_layers", list)())
        for layer in getattr(model, "state_layers", list)():
            shapes = layer.state_shapes()
            layer.bind_state(
                torch.full((num_state_slots, *shapes.conv_state), float("nan"), dtype=shapes.conv_dtype,
                           device=self.device),
                torch.full((num_state_slots, *shapes.recurrent_state), float("nan"), dtype=shapes.recurrent_dtype,
                           device=self.device))
        dtype = activation_dtype(model)
        level, step_kernels, ops = device_kernels(self.device, KernelConfig(), dtype)  # as the runner's
        self.plan = plan_model(model, PlanSettings(level, dtype, kv_cache_dtype or self.dtype, bound_layers,
                                                   kernels=step_kernels, ops=ops))
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks: list[int] = torch.randperm(num_blocks, generator=generator).tolist()
        self.free_slots: list[int] = torch.randperm(num_state_slots, generator=generator).tolist()
        self.block_tables: dict[str, list[int]] = {}
        self.state_slots: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Feed each sequence its next tokens, all in one model step; return each fed token's logits."""
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.num_computed.get(seq, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.num_computed[seq] = end
            if seq not in self.state_slots:
                self.state_slots[seq] = self.free_slots.pop()
        slots = [self.state_slots[seq] for seq in chunks] if self.has_state else None
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device, state_slots=slots)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids, device=self.device),
                                torch.tensor(positions, device=self.device), meta, plan=self.plan.bound)  # [T, E]
            logits = self.model.compute_logits(hidden)  # [T, V]
        return dict(zip(chunks, logits.split(query_lens)))

    def prefill(self, seq: str, tokens: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Feed a whole prompt in chunks of `chunk_size` (None: one chunk); logits of every token [L, V]."""
        size = chunk_size or len(tokens)
        chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
        return torch.cat([self.step({seq: chunk})[seq] for chunk in chunks])


def greedy_generate(model, prompt: list[int], max_new_tokens: int, **harness_kwargs) -> list[int]:
    """Prefill the prompt, then decode one token per step, always taking the argmax."""
    harness = PagedHarness(model, **harness_kwargs)
    next_token = int(harness.prefill("seq", prompt)[-1].argmax())
    generated = [next_token]
    while len(generated) < max_new_tokens:
        next_token = int(harness.step({"seq": [next_token]})["seq"][-1].argmax())
        generated.append(next_token)
    return generated
