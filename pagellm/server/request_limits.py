"""What a request may ask of this server and its model: completions the queue can hold, a prompt and an answer
that fit the context, token ids the vocabulary has. Each refusal is a 400 naming the field, with every count's
unit."""

from __future__ import annotations

from pagellm.server.errors import APIError


def check_capacity(max_waiting: int, body, num_prompts: int) -> None:
    """A request of more completions than the waiting queue can ever hold is a 400, not a 429 to retry forever."""
    count = num_prompts * body.n
    if count > max_waiting:
        field = "n" if body.n > 1 else "prompt"
        raise APIError(f"{num_prompts} prompt(s) x n={body.n} is {count} completions, more than this server ever "
                       f"queues at once ({max_waiting} requests, --max-waiting); split the request", field)


def check_token_ids(vocab_size: int, ids: list[int], param: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise APIError(f"{param}: token ids out of range [0, {vocab_size}): {bad[:5]}", param)


def max_tokens(limit: int, prompt_len: int, requested: int | None, prompt_param: str,
               tokens_param: str = "max_tokens") -> int:
    """vLLM's rule: the prompt must leave room, and a requested max_tokens must fit the context (`limit` tokens)."""
    prompt = "the prompt" if prompt_param == "prompt" else f"the prompt ({prompt_param})"
    if prompt_len >= limit:
        raise APIError(f"this model's maximum context length is {limit} tokens, and {prompt} has {prompt_len} "
                       "tokens; shorten it", prompt_param)
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise APIError(f"this model's maximum context length is {limit} tokens; {prompt} has {prompt_len} tokens, "
                       f"and {tokens_param} asks for {requested} more: {prompt_len + requested} tokens; lower "
                       f"{tokens_param} or shorten the prompt", tokens_param)
    return requested
