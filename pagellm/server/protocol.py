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

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, StrictBool, StrictStr, \
    ValidationError, WithJsonSchema

from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams
from pagellm.server.errors import APIError, shown
from pagellm.server.message_parts import (CHAT_ROLES, CHAT_TOOLS, ChatMessage, check_chat_messages, json_path,
                                          json_type)
from pagellm.server.structured_fields import structured_outputs_of
from pagellm.server.tool_calls import ToolChoice, check_tools, forced_grammar

MAX_N = 128  # completions per prompt; each is an engine request
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_JSON_DEPTH = 64  # nesting of a request body (a JSON schema inside it included)


Float = Annotated[float, Field(strict=True)]  # strict: a number, never a numeric string


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds: Any) -> Any:
    """An integer field, bounded by Field's ge, le, ...: a JSON number with no fractional part, as JSON Schema's
    integer (1851.0 is 1851), never a bool or a numeric string. The bounds sit inside the validator, so the
    published schema keeps them as minimum / maximum."""
    return Annotated[int, Strict(), Field(**bounds), BeforeValidator(_whole)]


TokenIds = list[Int(ge=0)]


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
    "spaces_between_special_tokens": one_of(True), "echo": absent, "suffix": one_of(""),
    # OpenAI
    "functions": absent, "function_call": _no_tool_forced, "audio": absent, "modalities": one_of(["text"]),
    "prediction": absent, "web_search_options": absent, "store": absent, "reasoning_effort": one_of(),
    "verbosity": one_of(), "cache_salt": one_of(),
}
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]  # OpenAI's


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra: refused (_NOT_YET) or reported as unknown

    model: StrictStr | None = None
    max_tokens: Int(ge=1) | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int(ge=-1) | None = None
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    n: Int(ge=1, le=MAX_N) = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    seed: Int() | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=100.0)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: StrictStr | None = None
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None  # vLLM's extra field

    best_of: Int(ge=1) | None = None
    logit_bias: dict[StrictStr, Float] | None = None  # token id (as JSON keys are strings) -> [-100, 100]
    min_tokens: Int(ge=0) = 0  # vLLM's extra field
    # Structured output (server/structured_fields.py): OpenAI's response_format, vLLM's two forms
    response_format: dict[StrictStr, Any] | None = None
    structured_outputs: dict[StrictStr, Any] | None = None
    guided_json: dict[StrictStr, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    # Hints that change nothing in the output (bookkeeping, cache routing): typed, so a wrong type is a 400 as
    # OpenAI's, and then unused
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    request_id: StrictStr | None = None  # vLLM's
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
                raise APIError(f"{name} is not supported yet (got {shown(value)}); leave it out", name)
        self._structured = structured_outputs_of(self)

    def unknown_fields(self) -> list[str]:
        """Names of fields sent that no model field or _NOT_YET entry knows: ignored (the server logs them)."""
        return sorted(name for name in (self.model_extra or {}) if name not in _NOT_YET)

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
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    # echo and suffix are refused (_NOT_YET) unless they ask for nothing: not declared, as not honoured

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and (not self.prompt or any(p == [] for p in self.prompt)):
            raise APIError("prompt must not be empty", "prompt")
        if len(self.prompts()) > MAX_PROMPTS:
            raise APIError(f"prompt holds {len(self.prompts())} prompts, more than the {MAX_PROMPTS} prompts one "
                           "request may hold", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """A string, a list of token ids, or a list of either, as a list of prompts."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


# apply_chat_template's own arguments: not template variables a request may set
_TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "chat_template", "template", "tokenize",
                                 "add_generation_prompt", "tools", "documents", "return_dict", "return_tensors"})


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: StrictBool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[Any], WithJsonSchema(CHAT_TOOLS)] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # vLLM's: extra variables for the template
    _tools: tuple = PrivateAttr(default=((), None))  # set by check(): (tools for the template, ToolChoice)

    @classmethod
    def check_raw(cls, data: dict) -> None:
        """The messages as sent, before pydantic: an error names the part (message_parts.py)."""
        if "messages" in data:
            check_chat_messages(data["messages"])

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", "top_logprobs")
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

    @classmethod
    def check_raw(cls, data: dict) -> None:
        if data.get("messages") is not None:
            check_chat_messages(data["messages"])

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
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
    "guided_json": "a JSON schema: an object or its JSON text",
}
# Fields whose errors name the part's whole path as their param, as OpenAI's do (messages[1].tool_calls[0])
_PATHED = frozenset({"messages", "input", "system"})
# pydantic's type errors as JSON's words
_TYPES = {"int_type": "an integer", "float_type": "a number", "string_type": "a string", "bool_type": "a boolean",
          "list_type": "a list", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object"}
# Location parts that name a union's member rather than a field or an index
_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "any"})


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
    check_raw = getattr(model, "check_raw", None)
    if check_raw is not None:  # parts whose errors pydantic's union messages would not point at
        check_raw(data)
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        # a model's own words for its union fields, over the shared ones (embeddings' input is not Responses')
        raise _validation_error(exc, {**_EXPECTED, **getattr(model, "expected_shapes", {})}) from None
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


def _validation_error(exc: ValidationError, expected: dict[str, str]) -> APIError:
    error = exc.errors()[0]
    loc = [part for i, part in enumerate(error["loc"]) if not _member_tag(part)
           and not (i and isinstance(error["loc"][i - 1], int) and part in CHAT_ROLES)]  # a message's class
    where = json_path(loc)
    param = str(loc[0]) if loc else None
    param = where if param in _PATHED else param
    kind, got = error["type"], error.get("input")
    if kind == "missing":
        return APIError(f"{where} is required", param)
    if param in expected and (len(loc) > 1 or kind.endswith("_type")):
        return APIError(f"{param} must be {expected[param]}", param)
    if kind in _TYPES:  # a number is shown (1.5 for an integer), anything else named by its type
        number = isinstance(got, (int, float)) and not isinstance(got, bool)
        return APIError(f"{where} must be {_TYPES[kind]}, got {shown(got) if number else json_type(got)}", param)
    return APIError(f"{where}: {error['msg']} (got {shown(got)})", param)


def _member_tag(part: Any) -> bool:
    """Whether a pydantic location part names a union member ('str', 'list[str]', 'function-after[...]',
    'constrained-str'), not a field or a client's own key (metadata's 'user-id' is kept)."""
    return isinstance(part, str) and (part in _MEMBER_TAGS or "[" in part or part.startswith("constrained-"))
