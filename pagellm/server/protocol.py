"""The OpenAI wire format: request models (OpenAI field names) and the error body.

Requests are parsed from raw bytes by `parse_request`, so every problem (invalid UTF-8, invalid
JSON, a wrong type, an out-of-range value) becomes an `APIError` with HTTP 400 and a `param`
naming the request field, never FastAPI's 422. Unknown fields are ignored, as vLLM does.
Ranges follow the OpenAI API reference (temperature in [0, 2], penalties in [-2, 2], at most
20 top logprobs).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # completions per prompt; each is an engine request


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              405: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind = kind or self._TYPES.get(status, "internal_server_error")

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param)


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


Float = Annotated[float, Field(strict=True)]  # strict: a number, never a numeric string
Int = StrictInt
TokenIds = list[Annotated[int, Field(strict=True, ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    seed: Int | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=100.0)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: StrictStr | None = None

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options can only be set when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, num_logprobs: int | None, child: int) -> SamplingParams:
        """The params of completion `child`; with a seed, child i uses seed + i (distinct, reproducible)."""
        values: dict[str, Any] = dict(max_tokens=max_tokens, logprobs=num_logprobs, ignore_eos=self.ignore_eos,
                                      stop=self.stop, stop_token_ids=self.stop_token_ids)
        if self.seed is not None:
            values["seed"] = self.seed + child
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        try:
            return SamplingParams(**values)
        except ValueError as exc:  # SamplingParams names the field first
            field = str(exc).split(" ", 1)[0]
            raise APIError(str(exc), field if field in type(self).model_fields else None) from exc


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError("echo is not supported", "echo")
        if self.suffix:
            raise APIError("suffix is not supported", "suffix")
        if isinstance(self.prompt, list) and (not self.prompt or any(p == [] for p in self.prompt)):
            raise APIError("prompt must not be empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """A string, a list of token ids, or a list of either, as a list of prompts."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        # The template has no notion of "developer": it is the system prompt under its new name.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.tools:
            raise APIError("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError("only response_format {'type': 'text'} is supported", "response_format")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: TokenIds

    def check(self) -> None:
        pass


# What a field takes, for type errors whose pydantic message would name one union member only.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {'role': ..., 'content': ...} objects with a known role "
                "(system, developer, user, assistant, tool) and text content",
}


def parse_request(raw: bytes, model: type[BaseModel]):
    """Bytes of a JSON body -> a validated request model, or APIError(400) naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not valid UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check()
    return request


def _validation_error(exc: ValidationError) -> APIError:
    error = exc.errors()[0]
    loc = error["loc"]
    param = str(loc[0]) if loc else None
    where = ".".join(str(part) for part in loc)
    if error["type"] == "missing":
        return APIError(f"{where} is required", param)
    if param in _EXPECTED and (len(loc) > 1 or error["type"].endswith("_type")):
        return APIError(f"{param} must be {_EXPECTED[param]}", param)
    return APIError(f"{where}: {error['msg']} (got {error.get('input')!r})"[:500], param)


# ---- responses --------------------------------------------------------------------------------------

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

    def _final_choice(self, index: int, output) -> dict:
        finish, stop = self._finish(output)
        completion = output.outputs[0]
        return {"index": index, "message": {"role": "assistant", "content": completion.text},
                "logprobs": self._logprobs(completion.logprobs), "finish_reason": finish, "stop_reason": stop}

    def _chunk_choice(self, index: int, output, logprobs) -> dict:
        finish, stop = self._finish(output)
        delta = {"content": output.new_text} if output.new_text else {}
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
