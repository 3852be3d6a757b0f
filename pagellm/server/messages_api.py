"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): a request becomes a chat request, and
the chat answer (text, reasoning, tool calls: server/responses.py's ChatFormatter) becomes content blocks, or
Anthropic's stream events. Claude-style clients and coding agents speak it; llama-server serves it too.

    system (text or text blocks)      -> a system message
    messages' blocks: text            -> the message's text; tool_use (assistant) -> its tool_calls;
                      tool_result     -> a tool message; thinking -> dropped (not shown to the template again)
    max_tokens, stop_sequences        -> max_tokens, stop;  temperature, top_p, top_k as they are
    tools {name, input_schema}        -> function tools;  tool_choice auto / any / tool / none -> auto / required /
                                         named / none;  disable_parallel_tool_use -> parallel_tool_calls false
    thinking {"type": "disabled"}     -> the template variable enable_thinking false
    output_config.format json_schema  -> response_format json_schema (grammar-enforced);  .effort -> the template
                                         variable reasoning_effort
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictStr, WithJsonSchema

from pagellm.server.errors import APIError, shown
from pagellm.server.converted_requests import ConvertedChatRequest, check_outer_fields, parse_converted
from pagellm.server.message_parts import (STRING, check_role, json_type, need_object, need_string, part_type,
                                          shape)
from pagellm.server.protocol import Float, Int, absent, one_of, parse_request
from pagellm.server.responses import ChatFormatter
from pagellm.server.streaming import typed_event

_FIELD_NAMES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking",
                "response_format": "output_config.format"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# Messages fields that would change the answer and are not honoured (server-side tools and context editing)
_REFUSED = {"container": one_of(), "mcp_servers": absent, "context_management": one_of()}
_NO_EFFECT = frozenset({"speed", "user_profile_id", "workspace_id", "diagnostics"})
_ROLES = ("user", "assistant")
_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# The declared shapes of what _messages, _chat_tool and _chat_tool_choice check by hand
_TEXT = shape(("type", "text"), type={"const": "text"}, text=STRING)
_THINKING = [shape(("type", "thinking"), type={"const": "thinking"}, thinking=STRING, signature=STRING),
             shape(("type",), type={"const": "redacted_thinking"}, data=STRING)]
_TOOL_USE = shape(("type", "id", "name", "input"), type={"const": "tool_use"}, id=STRING, name=STRING,
                  input={"type": "object"})
_TOOL_RESULT = shape(("type", "tool_use_id"), type={"const": "tool_result"}, tool_use_id=STRING,
                     content={"anyOf": [STRING, {"type": "array", "items": _TEXT}]}, is_error={"type": "boolean"})
_MESSAGES = {"type": "array", "minItems": 1, "items": {"anyOf": [
    shape(("role", "content"), role={"const": role}, content={"anyOf": [STRING, {"type": "array", "items": {
        "anyOf": [_TEXT, *blocks, *_THINKING]}}]})
    for role, blocks in (("user", [_TOOL_RESULT]), ("assistant", [_TOOL_USE]))]}}
_SYSTEM = {"anyOf": [STRING, {"type": "array", "items": _TEXT}, {"type": "null"}]}
_TOOLS = {"type": "array", "items": shape(("name",), name={"type": "string", "minLength": 1}, description=STRING,
                                          input_schema={"type": "object"}, type={"const": "custom"})}
_THINKING_CONFIG = shape(("type",), type={"enum": ["enabled", "adaptive", "disabled"]},
                         budget_tokens={"type": "integer"})
_TOOL_CHOICE = shape(("type",), type={"enum": ["auto", "any", "tool", "none"]}, name=STRING,
                     disable_parallel_tool_use={"type": "boolean"})


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    user_id: StrictStr | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # Anthropic's fields with no effect here (_NO_EFFECT), or unknown

    model: StrictStr | None = None
    max_tokens: Int(ge=1)
    messages: Annotated[list[Any], WithJsonSchema(_MESSAGES)]
    system: Annotated[StrictStr | list[Any] | None, WithJsonSchema(_SYSTEM)] = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int(ge=0) | None = None
    stream: StrictBool = False
    # no effect on the answer (bookkeeping, capacity, caching): typed, so a wrong type is a 400 as Anthropic's
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[StrictStr, Any] | None = None
    inference_geo: StrictStr | None = None
    tools: Annotated[list[Any], WithJsonSchema(_TOOLS)] | None = None
    tool_choice: Annotated[dict[StrictStr, Any], WithJsonSchema(_TOOL_CHOICE)] | None = None
    thinking: Annotated[dict[StrictStr, Any], WithJsonSchema(_THINKING_CONFIG)] | None = None
    output_config: dict[StrictStr, Any] | None = None

    _unknown: tuple[str, ...] = PrivateAttr(default=())  # fields nobody knows: ignored (logged by the server)

    @classmethod
    def check_raw(cls, data: dict) -> None:
        if "max_tokens" in data and data["max_tokens"] is None and cls.model_fields["max_tokens"].is_required():
            raise APIError("max_tokens is required: an integer of at least 1 (null is not accepted)", "max_tokens")

    def check(self) -> None:
        kind = (self.thinking or {}).get("type")
        if self.thinking is not None and kind not in ("enabled", "adaptive", "disabled"):
            raise APIError(f"thinking.type must be enabled, adaptive or disabled, got {shown(kind)}", "thinking")
        self._unknown = check_outer_fields(self.model_extra, _REFUSED, _NO_EFFECT)


class CountTokensRequest(MessagesRequest):
    max_tokens: Int(ge=1) | None = None


def chat_request(raw: bytes, model: type[MessagesRequest] = MessagesRequest) -> ConvertedChatRequest:
    """The chat form of a Messages (or count_tokens) request; APIError(400) naming the Messages field."""
    request = parse_request(raw, model)
    messages, origins = _messages(request)
    chat: dict[str, Any] = {"messages": messages, "stream": request.stream}
    for name in ("model", "max_tokens", "temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.stream:
        chat["stream_options"] = {"include_usage": True}  # message_delta carries the output tokens
    if request.stop_sequences:
        chat["stop"] = request.stop_sequences
    if request.tools:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        chat["tool_choice"], parallel = _chat_tool_choice(request.tool_choice)
        chat["parallel_tool_calls"] = parallel
    kwargs = {"enable_thinking": False} if (request.thinking or {}).get("type") == "disabled" else {}
    config = request.output_config or {}
    if config.get("effort") is not None:
        if not isinstance(config["effort"], str):
            raise APIError(f"output_config.effort must be a string, got {json_type(config['effort'])}",
                           "output_config")
        kwargs["reasoning_effort"] = config["effort"]
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if config.get("format") is not None:
        fmt = config["format"]
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(f"output_config.format must be {{'type': 'json_schema', 'schema': {{...}}}}, got "
                           f"{fmt!r:.100}", "output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return parse_converted(chat, ConvertedChatRequest, _FIELD_NAMES, request._unknown, origins)


def _messages(request: MessagesRequest) -> tuple[list[dict], list[str]]:
    """Chat messages of system and messages, and beside each the part it came from (errors name that part)."""
    system = request.system
    if isinstance(system, list):
        system = "\n".join(_block_text(block, f"system[{j}]") for j, block in enumerate(system))
    messages, origins = ([{"role": "system", "content": system}], ["system"]) if system else ([], [])
    if not request.messages:
        raise APIError("messages must hold at least one message", "messages")
    for i, message in enumerate(request.messages):
        path = f"messages[{i}]"
        need_object(message, path, "a message object {'role': 'user' | 'assistant', 'content': ...}")
        role = check_role(message, path, _ROLES, "; a system prompt goes in the top-level system field")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            origins.append(path)
        elif isinstance(content, list):
            turn, where = _blocks(role, content, path)
            messages += turn
            origins += where
        else:
            problem = "is required" if content is None else f"must be a string or a list of content blocks, got " \
                f"{json_type(content)}"
            raise APIError(f"{path}.content {problem}", f"{path}.content")
    return messages, origins


def _blocks(role: str, blocks: list, path: str) -> tuple[list[dict], list[str]]:
    """One message's blocks as chat messages: one per tool result, then its text (and an assistant's calls); and
    beside each the part it came from."""
    texts, calls, results, origins = [], [], [], []
    for j, block in enumerate(blocks):
        where = f"{path}.content[{j}]"
        kind = part_type(block, where, _BLOCKS, "content block")
        if kind in ("tool_use", "tool_result") and role != ("assistant" if kind == "tool_use" else "user"):
            raise APIError(f"{where}: {kind} blocks belong in {'assistant' if kind == 'tool_use' else 'user'} "
                           "messages", where)
        if kind == "text":
            texts.append(need_string(block, "text", where))
        elif kind == "tool_use":
            tool_input = block.get("input", {})
            if not isinstance(tool_input, dict):
                raise APIError(f"{where}.input must be an object, got {json_type(tool_input)}", f"{where}.input")
            calls.append({"id": need_string(block, "id", where), "type": "function", "function": {
                "name": need_string(block, "name", where), "arguments": json.dumps(tool_input)}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": need_string(block, "tool_use_id", where),
                            "content": _result_text(block.get("content"), f"{where}.content")})
            origins.append(where)
    if texts or calls or not results:
        results.append({"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
        origins.append(path)
    return results, origins


def _result_text(content: Any, path: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"{path} must be a string or a list of content blocks, got {json_type(content)}", path)
    return "\n".join(_block_text(block, f"{path}[{k}]") for k, block in enumerate(content))


def _block_text(block: Any, where: str) -> str:
    part_type(block, where, ("text",), "content block")
    return need_string(block, "text", where)


def _chat_tool(i: int, tool: Any) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"] or \
            tool.get("type") not in (None, "custom"):
        raise APIError(f"tools[{i}] must be {{'name': ..., 'input_schema': {{...}}}} (server tools are not "
                       "supported)", "tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict) -> tuple[Any, bool]:
    """(chat's tool_choice, parallel_tool_calls)."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    raise APIError(f"tool_choice.type must be auto, any, tool or none, got {shown(kind)}", "tool_choice")


class MessagesFormatter:
    """Anthropic's envelope around a ChatFormatter: a message with content blocks, or its stream of events."""

    done_marker = ""  # a Messages stream ends with message_stop

    def __init__(self, model_name: str, chat: ChatFormatter, prompt_tokens: int, stops: list[str] | None):
        self.request_id = f"msg_{uuid.uuid4().hex}"
        self._model, self._chat, self._prompt_tokens, self._stops = model_name, chat, prompt_tokens, stops or []
        self._open: tuple[str, int] | None = None  # (block type, index) of the block being streamed
        self._blocks = 0
        self._finish: tuple[str | None, Any] = (None, None)
        self._called = False  # a tool_use block was streamed

    def response(self, outputs: list, usage_: dict) -> dict:
        choice = self._chat.response(outputs, usage_)["choices"][0]
        message, blocks = choice["message"], []
        if message.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        blocks += [_tool_use(call) for call in message.get("tool_calls") or ()]
        stop_reason, sequence = self._stop_reason(choice["finish_reason"], choice["stop_reason"],
                                                  bool(message.get("tool_calls")))
        return {"id": self.request_id, "type": "message", "role": "assistant", "model": self._model,
                "content": blocks, "stop_reason": stop_reason, "stop_sequence": sequence, "usage": _usage(usage_)}

    def _stop_reason(self, finish: str | None, stop: Any, called: bool) -> tuple[str | None, str | None]:
        if called:
            return "tool_use", None
        if finish == "stop" and isinstance(stop, str) and stop in self._stops:
            return "stop_sequence", stop
        return _STOP_REASONS.get(finish, "end_turn" if finish else None), None

    # ---- a stream of events (api_server's _sse drives these) ---------------------------------------------

    event = staticmethod(typed_event)

    @staticmethod
    def error_event(message: str, kind: str) -> str:
        """Anthropic's error event: the client raises on it (an overloaded server, or the request's own failure)."""
        anthropic_kind = "overloaded_error" if kind == "service_unavailable_error" else "api_error"
        return typed_event({"type": "error", "error": {"type": anthropic_kind, "message": message}})

    def first_chunks(self, num_choices: int, include_usage: bool) -> list[dict]:
        message = {"id": self.request_id, "type": "message", "role": "assistant", "model": self._model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self._prompt_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def chunk(self, index: int, output, include_usage: bool) -> list[dict]:
        chunk = self._chat.chunk(index, output, False)
        if chunk is None:
            return []
        choice, events = chunk["choices"][0], []
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._close()
            block = {**_tool_use(call), "input": {}}
            events.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
            events.append({"type": "content_block_delta", "index": self._blocks,
                           "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
            events.append({"type": "content_block_stop", "index": self._blocks})
            self._blocks += 1
        if choice["finish_reason"] is not None:
            self._finish = (choice["finish_reason"], choice["stop_reason"])
        self._called |= bool(delta.get("tool_calls"))
        return events

    def last_chunks(self, usage_: dict, include_usage: bool) -> list[dict]:
        stop_reason, sequence = self._stop_reason(*self._finish, self._called)
        return self._close() + [{"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                     "stop_sequence": sequence},
                                 "usage": _usage(usage_)}, {"type": "message_stop"}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open[0] != kind:
            events += self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
            self._open = (kind, self._blocks)
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": self._open[1], "delta": delta}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open[1], None
        self._blocks += 1
        return [{"type": "content_block_stop", "index": index}]


def _tool_use(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    try:
        tool_input = json.loads(arguments)
    except json.JSONDecodeError:
        tool_input = {"_raw": arguments}  # a call whose arguments are not JSON: kept, not lost
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": tool_input}


def _usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_creation_input_tokens": 0}
