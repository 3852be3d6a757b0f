"""Embedding requests (SamplingParams.pooling): a prompt's final hidden states pooled into one vector.

An embedding request is a prefill-only request: scheduled, chunked and budgeted like any prompt, it never
samples, and its prompt's last chunk hands the pooled vector back (ModelOutput.pooled); the engine then finishes
it and its blocks return to the pool. Chunks may span steps, so the pool is kept per slot on the device:

    mean   the sum of every prompt row, divided by the prompt's length at the last chunk
    cls    the first prompt row (the chunk at position 0)
    last   the last prompt row (the last chunk's)

It never reads the prefix cache (kv_cache_manager._reads_cache): every position's hidden state is needed. The
hidden states are the model's final ones (after its last norm), as HF's last_hidden_state; normalising is the
caller's choice (the server's and LLM.embed's default).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.kernels.transfers import HostRead
from pagellm.core.types import ScheduledRequest
from pagellm.runner.input_batch import SlotState


def pool_rows(hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest],
              states: Sequence[SlotState]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """hidden [T, E] of the step: each embedding request's chunk folded into its pool; the pooled vectors of the
    requests whose prompt ends here, read back in one host read."""
    done: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for item, state in zip(scheduled, states):
        n, mode = len(item.token_ids), state.sampling_params.pooling
        if mode is not None:
            rows = hidden[offset : offset + n]  # [n, E]
            if item.start_position == 0:  # a first chunk (or a restart after preemption): a fresh pool
                state.pooled = None
            if mode == "mean":
                part = rows.float().sum(dim=0)
                state.pooled = part if state.pooled is None else state.pooled + part
            elif mode == "last" or (mode == "cls" and item.start_position == 0):
                state.pooled = rows[0 if mode == "cls" else -1].float()
            prompt_len = len(state.prompt_token_ids)
            if item.start_position + n == prompt_len:
                done.append((item.request_id, state.pooled / prompt_len if mode == "mean" else state.pooled))
        offset += n
    if not done:
        return ()
    vectors = HostRead(torch.stack([vector for _, vector in done])).tolist()  # [R, E]
    return tuple((request_id, tuple(vector)) for (request_id, _), vector in zip(done, vectors))
