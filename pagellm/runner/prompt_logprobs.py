"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): the logits of a chunk's prompt positions.

A request that asked for them has, besides its sampled row, the first `num_prompt_logits` rows of
its chunk scored (ScheduledRequest): row p predicts prompt token p + 1. No other row reaches the LM
head, so requests that did not ask pay nothing. The rows go through the head in passes of at most
ROWS_PER_PASS, so a long chunk never holds its whole [T, V] fp32 logits (and their log-softmax):

    hidden [T, E] ─► prompt rows [R] ─► per pass: logits [<=128, V] ─► log_softmax ─► the prompt
                                        token's logprob and rank, the top-k ─► one host read per step

A tensor-parallel worker runs the same passes (each LM-head pass is a gather to the head rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from pagellm.kernels.transfers import HostRead, to_device

from pagellm.core.types import PromptLogprobs, ScheduledRequest, TokenLogprobs
from pagellm.runner.input_batch import SlotState
from pagellm.runner.sampler import gather_logprobs

# Bounds a pass's memory: 128 rows of Gemma 3's 262144-token vocabulary are 128 MiB of fp32 logits, and
# as much again for their log-softmax, whatever the chunk size (max_num_batched_tokens).
ROWS_PER_PASS = 128

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]  # [N, E] hidden -> [N, V] fp32 logits


def prompt_rows(scheduled: Sequence[ScheduledRequest]) -> list[int]:
    """Rows of the step's packed hidden states whose logits score a prompt token, in scheduled order."""
    rows, offset = [], 0
    for item in scheduled:
        rows.extend(range(offset, offset + item.num_prompt_logits))
        offset += len(item.token_ids)
    return rows


def logits_passes(compute_logits: ComputeLogits, hidden: torch.Tensor, rows: list[int]) -> Iterator[torch.Tensor]:
    """The rows' logits, ROWS_PER_PASS rows at a time, in order."""
    index = to_device(rows, torch.int64, hidden.device)
    for start in range(0, len(rows), ROWS_PER_PASS):
        yield compute_logits(hidden[index[start : start + ROWS_PER_PASS]])


def score_prompt_rows(compute_logits: ComputeLogits, hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest],
                      states: Sequence[SlotState]) -> tuple[PromptLogprobs, ...]:
    """Per request with prompt rows in this step: each row's next prompt token's logprob, rank and top-k."""
    asking = [(item, state) for item, state in zip(scheduled, states) if item.num_prompt_logits]
    if not asking:
        return ()
    targets: list[int] = []
    for item, state in asking:
        first = item.start_position + 1  # the prompt token the chunk's first row predicts
        targets.extend(state.prompt_token_ids[first : first + item.num_prompt_logits])
    target_ids = to_device(targets, torch.int64, hidden.device)
    num_top = max(state.sampling_params.prompt_logprobs for _, state in asking)
    packed, done = [], 0
    for logits in logits_passes(compute_logits, hidden, prompt_rows(scheduled)):
        n = logits.shape[0]
        lp = gather_logprobs(logits.float().log_softmax(dim=-1), target_ids[done : done + n], num_top)
        # ids as floats, like the sampler's read-back: exact below 2**24, far above any vocabulary
        packed.append(torch.cat([lp.sampled_logprobs[:, None], lp.sampled_ranks[:, None].float(),
                                 lp.top_ids.float(), lp.top_logprobs], dim=1))  # [n, 2 + 2K]
        done += n
    data = HostRead(torch.cat(packed)).tolist()  # one host read for every prompt row of the step
    return _split_by_request(data, targets, asking, num_top)


def _split_by_request(data: list[list[float]], targets: list[int],
                      asking: list[tuple[ScheduledRequest, SlotState]], num_top: int) -> tuple[PromptLogprobs, ...]:
    """The step's packed rows [logprob, rank, K top ids, K top logprobs] back into per-request entries."""
    results, row = [], 0
    for item, state in asking:
        k = state.sampling_params.prompt_logprobs
        entries = []
        for values, token in zip(data[row : row + item.num_prompt_logits], targets[row:]):
            top = tuple((int(i), v) for i, v in zip(values[2 : 2 + k], values[2 + num_top : 2 + num_top + k]))
            entries.append(TokenLogprobs(token, values[0], int(values[1]), top))
        results.append(PromptLogprobs(item.request_id, item.start_position + 1, tuple(entries)))
        row += item.num_prompt_logits
    return tuple(results)
