"""The OpenAI wire format of answers: one HTTP request's response object or SSE chunks.

Completions use the legacy logprobs shape (parallel lists), chat the `content` list; vLLM's extra
`prompt_logprobs` go on each completion choice and beside a chat response's choices. JSON has no
-inf, so logprobs are clamped to -9999 as vLLM does.
"""

from __future__ import annotations

import time
import uuid

from pagellm.server.reasoning import ReasoningSplitter, split
from pagellm.server.tool_calls import ToolCallStream, parse_auto, parse_forced

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def usage(prompt_lens: list[int], outputs: list, n: int) -> dict:
    """OpenAI usage of one HTTP request: each prompt counted once, whatever n is.

    cached_tokens is, per prompt, the most prompt tokens any of its n completions read from the
    prefix cache: with n > 1 the first completion computes the shared full blocks and the others
    read them, so this is the part of the prompt computed once for all n.
    """
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(max((o.num_cached_tokens for o in outputs[p * n:(p + 1) * n]), default=0)
                 for p in range(len(prompt_lens)))
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Formatter:
    """Builds one HTTP request's response objects and SSE chunks; keeps per-choice stream progress."""

    object_name = chunk_object = id_prefix = ""

    def __init__(self, model_name: str, body, tokenizer):
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.body = body
        self._tokenizer = tokenizer
        self._logprobs_sent: dict[int, int] = {}  # choice index -> logprob entries already streamed

    def first_chunks(self, num_choices: int, include_usage: bool) -> list[dict]:
        return []

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._envelope(self.chunk_object), "choices": [], "usage": usage_}

    def response(self, outputs: list, usage_: dict) -> dict:
        choices = [self._final_choice(i, o) for i, o in enumerate(outputs)]
        return {**self._envelope(self.object_name), "choices": choices, "usage": usage_}

    @staticmethod
    def _prompt_logprobs(output) -> list | None:
        """vLLM's wire shape: None, then per prompt token {"token id": {logprob, rank, decoded_token}}."""
        if output.prompt_logprobs is None:
            return None
        return [None if position is None else
                {str(token_id): {"logprob": max(entry.logprob, _MIN_LOGPROB), "rank": entry.rank,
                                 "decoded_token": entry.decoded_token} for token_id, entry in position.items()}
                for position in output.prompt_logprobs]

    def chunk(self, index: int, output, include_usage: bool) -> dict | None:
        """The SSE chunk for one engine output, or None when it released no text and did not finish."""
        if not output.new_text and not output.finished:
            return None  # held back (a possible stop string); its logprobs go out with the next chunk
        choice = self._chunk_choice(index, output, self._unsent_logprobs(index, output))
        chunk = {**self._envelope(self.chunk_object), "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self, object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}

    def _unsent_logprobs(self, index: int, output) -> list | None:
        entries = output.outputs[0].logprobs
        if entries is None:
            return None
        start = self._logprobs_sent.get(index, 0)
        self._logprobs_sent[index] = len(entries)
        return entries[start:]

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer else ""

    @staticmethod
    def _finish(output) -> tuple[str | None, str | int | None]:
        completion = output.outputs[0]
        return (completion.finish_reason, completion.stop_reason) if output.finished else (None, None)


class CompletionFormatter(_Formatter):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model_name: str, body, tokenizer):
        super().__init__(model_name, body, tokenizer)
        self._text_offset: dict[int, int] = {}

    def response(self, outputs: list, usage_: dict) -> dict:
        """vLLM puts prompt_logprobs on each choice: those of its prompt, computed by the prompt's first child."""
        response = super().response(outputs, usage_)
        n = self.body.n
        for index, choice in enumerate(response["choices"]):
            choice["prompt_logprobs"] = self._prompt_logprobs(outputs[index - index % n])
        return response

    def _final_choice(self, index: int, output) -> dict:
        finish, stop = self._finish(output)
        completion = output.outputs[0]
        return {"index": index, "text": completion.text, "logprobs": self._logprobs(index, completion.logprobs),
                "finish_reason": finish, "stop_reason": stop}

    def _chunk_choice(self, index: int, output, logprobs) -> dict:
        finish, stop = self._finish(output)
        return {"index": index, "text": output.new_text, "logprobs": self._logprobs(index, logprobs),
                "finish_reason": finish, "stop_reason": stop}

    def _logprobs(self, index: int, entries) -> dict | None:
        """The legacy completions shape: parallel lists, top_logprobs as {token: logprob} dicts."""
        if entries is None:
            return None
        result = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        offset = self._text_offset.get(index, 0)
        for entry in entries:
            token = self._token_text(entry.token_id)
            top = {self._token_text(t): max(lp, _MIN_LOGPROB) for t, lp in entry.top}
            top.setdefault(token, max(entry.logprob, _MIN_LOGPROB))  # the sampled token is always listed
            result["text_offset"].append(offset)
            result["token_logprobs"].append(max(entry.logprob, _MIN_LOGPROB))
            result["tokens"].append(token)
            result["top_logprobs"].append(top)
            offset += len(token)
        self._text_offset[index] = offset
        return result


class ChatFormatter(_Formatter):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model_name: str, body, tokenizer, opened_reasoning: bool | None = None,
                 tool_call_parser: str = "hermes"):
        """opened_reasoning: None for a model that does not think (no split); else whether the prompt left
        `<think>` open (server/reasoning.py). tool_call_parser: the model's call format (server/tool_calls.py)."""
        super().__init__(model_name, body, tokenizer)
        self._opened = opened_reasoning
        self._splitters: dict[int, ReasoningSplitter] = {}
        choice = getattr(body, "tool_choice_mode", None)
        self._tool_choice = choice if choice is not None and choice.mode != "none" else None
        self._parser = tool_call_parser
        self._tool_streams: dict[int, ToolCallStream] = {}

    def first_chunks(self, num_choices: int, include_usage: bool) -> list[dict]:
        """As OpenAI and vLLM do: each choice opens with a delta carrying the role."""
        chunks = []
        for index in range(num_choices):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            chunk = {**self._envelope(self.chunk_object), "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    def response(self, outputs: list, usage_: dict) -> dict:
        """vLLM puts a chat response's prompt_logprobs beside its choices (one prompt)."""
        return {**super().response(outputs, usage_), "prompt_logprobs": self._prompt_logprobs(outputs[0])}

    def _final_choice(self, index: int, output) -> dict:
        finish, stop = self._finish(output)
        completion = output.outputs[0]
        message = {"role": "assistant", "content": completion.text}
        if self._opened is not None:
            message["reasoning_content"], message["content"] = split(completion.text, self._opened)
        if self._tool_choice is not None:
            message["content"], calls = self._tool_calls(message["content"] or "")
            if calls:
                message["tool_calls"] = calls
                finish = self._tool_finish(finish)
        return {"index": index, "message": message, "logprobs": self._logprobs(completion.logprobs),
                "finish_reason": finish, "stop_reason": stop}

    def _tool_calls(self, content: str) -> tuple[str | None, list[dict]]:
        if self._tool_choice.forced:
            calls = parse_forced(content, self._tool_choice)
            return (None if calls else content), self._limit(calls)
        rest, calls = parse_auto(content, self._parser)
        return rest, self._limit(calls)

    def _limit(self, calls: list[dict]) -> list[dict]:
        return calls if self.body.parallel_tool_calls else calls[:1]

    def _tool_finish(self, finish: str | None) -> str | None:
        """OpenAI: "tool_calls" when the model chose to call, "stop" when a named call was forced."""
        return "tool_calls" if finish == "stop" and self._tool_choice.mode != "named" else finish

    def _chunk_choice(self, index: int, output, logprobs) -> dict:
        finish, stop = self._finish(output)
        if self._opened is None:
            reasoning, content = "", output.new_text or ""
        else:
            splitter = self._splitters.setdefault(index, ReasoningSplitter(self._opened))
            reasoning, content = splitter.feed(output.new_text or "", final=output.finished)
        calls = []
        if self._tool_choice is not None:
            stream = self._tool_streams.setdefault(index, ToolCallStream(self._tool_choice, self._parser))
            content, calls = stream.feed(content, final=output.finished)
        delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(self._limit(calls))]
            finish = self._tool_finish(finish)
        return {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish,
                "stop_reason": stop}

    def _logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        return {"content": [self._entry(e.token_id, e.logprob, [self._entry(t, lp) for t, lp in e.top])
                            for e in entries]}

    def _entry(self, token_id: int, logprob: float, top: list | None = None) -> dict:
        token = self._token_text(token_id)
        entry = {"token": token, "logprob": max(logprob, _MIN_LOGPROB), "bytes": list(token.encode("utf-8"))}
        if top is not None:
            entry["top_logprobs"] = top
        return entry
