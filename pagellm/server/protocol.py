"""The OpenAI wire format of requests: request models (OpenAI field names) and the error body.

Requests are parsed from raw bytes by `parse_request`, so every problem (invalid UTF-8, invalid
JSON, a wrong type, an out-of-range value) becomes an `APIError` with HTTP 400 and a `param`
naming the request field, never FastAPI's 422. Unknown fields are ignored, as vLLM does.
Ranges follow the OpenAI API reference (temperature in [0, 2], penalties in [-2, 2], at most
20 top logprobs).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, StrictStr, ValidationError

from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams
from pagellm.server.errors import APIError, error_body  # noqa: F401  (error_body: part of this module's API)
from pagellm.server.structured_fields import structured_outputs_of
from pagellm.server.tool_calls import ToolChoice, check_tools, forced_grammar

MAX_N = 128  # completions per prompt; each is an engine request
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_JSON_DEPTH = 64  # nesting of a request body (a JSON schema inside it included)


Float = Annotated[float, Field(strict=True)]  # strict: a number, never a numeric string
Int = StrictInt
TokenIds = list[Annotated[int, Field(strict=True, ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


def absent(value: Any) -> bool:
    return value is None or value == {} or value == [] or value is False or value == 0


def _no_tool_forced(value: Any) -> bool:
    return value is None or value in ("none", "auto")


def one_of(*values: Any):
    return lambda value: value is None or value in values


# Fields of the OpenAI and vLLM request shapes that pagellm does not honour: name -> whether a value asks for
# nothing, so the field can be dropped with no change to the output. Anything else is a 400 naming it.
_NOT_YET = {
    # vLLM
    "allowed_token_ids": absent, "bad_words": absent, "use_beam_search": absent, "length_penalty": one_of(1, 1.0),
    "include_stop_str_in_output": absent, "skip_special_tokens": one_of(True), "truncate_prompt_tokens": one_of(),
    "continue_final_message": absent, "logits_processors": absent, "priority": absent, "documents": absent,
    "chat_template": one_of(), "mm_processor_kwargs": absent, "return_tokens_as_token_ids": absent,
    "kv_transfer_params": absent, "vllm_xargs": absent, "add_special_tokens": one_of(False),
    "spaces_between_special_tokens": one_of(True), "echo": absent,
    # OpenAI
    "functions": absent, "function_call": _no_tool_forced, "audio": absent, "modalities": one_of(["text"]),
    "prediction": absent, "web_search_options": absent, "store": absent, "reasoning_effort": one_of(),
    "verbosity": one_of(), "cache_salt": one_of(),
}
# Hints that change nothing in the output (bookkeeping and cache routing): accepted and not reported as unknown.
_NO_EFFECT = frozenset({"metadata", "service_tier", "prompt_cache_key", "safety_identifier", "request_id"})


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra: refused (_NOT_YET) or reported as unknown

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
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM's extra field

    best_of: Annotated[Int, Field(ge=1)] | None = None
    logit_bias: dict[StrictStr, Float | Int] | None = None  # token id (as JSON keys are strings) -> [-100, 100]
    min_tokens: Annotated[Int, Field(ge=0)] = 0  # vLLM's extra field
    # Structured output (server/structured_fields.py): OpenAI's response_format, vLLM's two forms
    response_format: dict[StrictStr, Any] | None = None
    structured_outputs: dict[StrictStr, Any] | None = None
    guided_json: dict[StrictStr, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    _structured: tuple | None = PrivateAttr(default=None)  # set by check(): (StructuredOutputs, its field)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs:  # vLLM's rule: a stream has no place for them (0 passes)
            raise APIError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.best_of is not None and self.best_of != self.n:  # best_of = n is plain sampling
            raise APIError(f"best_of other than n ({self.n}) is not supported", "best_of")
        for name, value in (self.model_extra or {}).items():
            if name in _NOT_YET and not _NOT_YET[name](value):
                raise APIError(f"{name} is not supported yet (got {value!r:.100}); leave it out", name)
        self._structured = structured_outputs_of(self)

    def unknown_fields(self) -> list[str]:
        """Names of fields sent that no model field, _NOT_YET or _NO_EFFECT entry knows: ignored (the server logs
        them)."""
        return sorted(name for name in (self.model_extra or {}) if name not in _NOT_YET and name not in _NO_EFFECT)

    @property
    def structured(self) -> tuple | None:
        """(StructuredOutputs, the request field that asked for it), or None."""
        return self._structured

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, num_logprobs: int | None, child: int) -> SamplingParams:
        """The params of completion `child`; with a seed, child i uses seed + i (distinct, reproducible).

        prompt_logprobs go to child 0 alone (the n children share the prompt; the rest keep their prefix-cache
        hits) and never to a stream, which does not return them.
        """
        values: dict[str, Any] = dict(max_tokens=max_tokens, logprobs=num_logprobs, ignore_eos=self.ignore_eos,
                                      stop=self.stop, stop_token_ids=self.stop_token_ids, logit_bias=self.logit_bias,
                                      min_tokens=self.min_tokens,
                                      structured_outputs=self.structured[0] if self.structured else None)
        if child == 0 and not self.stream:
            values["prompt_logprobs"] = self.prompt_logprobs
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
        if len(self.prompts()) > MAX_PROMPTS:
            raise APIError(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(self.prompts())}", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """A string, a list of token ids, or a list of either, as a list of prompts."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers
    name: StrictStr | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        # The template has no notion of "developer": it is the system prompt under its new name.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            # Templates write arguments with `| tojson`: an object, or they would quote the JSON text again.
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# apply_chat_template's own arguments: not template variables a request may set
_TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "chat_template", "template", "tokenize",
                                 "add_generation_prompt", "tools", "documents", "return_dict", "return_tensors"})


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # vLLM's: extra variables for the template
    _tools: tuple = PrivateAttr(default=((), None))  # set by check(): (tools for the template, ToolChoice)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id is None:
                raise APIError(f"messages[{i}]: a tool message needs tool_call_id", "messages")
        tools, choice = check_tools(self.tools, self.tool_choice)
        self._tools = (tools, choice)
        grammar = forced_grammar(tools, choice, self.parallel_tool_calls)
        if grammar is not None:
            if self.structured is not None:
                raise APIError(f"tool_choice {choice.mode} cannot be combined with {self.structured[1]}",
                               self.structured[1])
            self._structured = (grammar, "tool_choice")
        taken = sorted(set(self.chat_template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template is given: none under tool_choice "none"."""
        tools, choice = self._tools
        return list(tools) if tools and choice.mode != "none" else None

    @property
    def tool_choice_mode(self) -> ToolChoice:
        return self._tools[1]

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

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
    except RecursionError:
        raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check()
    return request


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Whether lists / objects nest deeper than `limit` (iterative: a deep body must not overflow the stack)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


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
