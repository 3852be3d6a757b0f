"""What generate() returns: the vLLM output shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.types import TokenLogprobs


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: one token's entry in a prompt_logprobs dict (keyed by token id)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # None without a tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the last step (for streaming)
    new_text: str = ""  # text released by the last step (for streaming)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token id: Logprob} holding the
    # prompt token and the top-k; None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when this request alone failed inside the engine (it is finished, "abort")
    embedding: list[float] | None = None  # an embedding request's pooled hidden state (SamplingParams.pooling)
    first_scheduled_time: float | None = None  # time.monotonic() when it first ran: its queue time ends there
