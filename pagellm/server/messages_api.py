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
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, StrictBool, StrictStr

from pagellm.server.errors import APIError
from pagellm.server.converted_requests import ConvertedChatRequest, check_outer_fields, parse_converted
from pagellm.server.protocol import absent, one_of, parse_request
from pagellm.server.responses import ChatFormatter
from pagellm.server.streaming import typed_event

_FIELD_NAMES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking", "response_format": "output_config"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# Messages fields that would change the answer and are not honoured (server-side tools and context editing)
_REFUSED = {"container": one_of(), "mcp_servers": absent, "context_management": one_of()}
_NO_EFFECT = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id",
                        "workspace_id", "diagnostics"})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ...: no effect

    model: StrictStr | None = None
    max_tokens: Any
    messages: list[Any]
    system: StrictStr | list[Any] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    stream: StrictBool = False
    tools: list[Any] | None = None
    tool_choice: dict[StrictStr, Any] | None = None
    thinking: dict[StrictStr, Any] | None = None
    output_config: dict[StrictStr, Any] | None = None

    _unknown: tuple[str, ...] = PrivateAttr(default=())  # fields nobody knows: ignored (logged by the server)

    def check(self) -> None:
        kind = (self.thinking or {}).get("type")
        if self.thinking is not None and kind not in ("enabled", "adaptive", "disabled"):
            raise APIError(f"thinking.type must be enabled, adaptive or disabled, got {kind!r:.50}", "thinking")
        self._unknown = check_outer_fields(self.model_extra, _REFUSED, _NO_EFFECT)


class CountTokensRequest(MessagesRequest):
    max_tokens: Any = None


def chat_request(raw: bytes, model: type[MessagesRequest] = MessagesRequest) -> ConvertedChatRequest:
    """The chat form of a Messages (or count_tokens) request; APIError(400) naming the Messages field."""
    request = parse_request(raw, model)
    chat: dict[str, Any] = {"messages": _messages(request), "stream": request.stream}
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
        kwargs["reasoning_effort"] = config["effort"]
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if config.get("format") is not None:
        fmt = config["format"]
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(f"output_config.format must be {{'type': 'json_schema', 'schema': {{...}}}}, got "
                           f"{fmt!r:.100}", "output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return parse_converted(chat, ConvertedChatRequest, _FIELD_NAMES, request._unknown)


def _messages(request: MessagesRequest) -> list[dict]:
    system = request.system
    if isinstance(system, list):
        system = "\n".join(_block_text(block, "system") for block in system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(request.messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise APIError(f"messages[{i}] must be {{'role': 'user' | 'assistant', 'content': ...}}", "messages")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            messages += _blocks(message["role"], content, i)
        else:
            raise APIError(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    return messages


def _blocks(role: str, blocks: list, i: int) -> list[dict]:
    """One message's blocks as chat messages: its text (and an assistant's calls), then one per tool result."""
    texts, calls, results = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_block_text(block, f"messages[{i}]"))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            text = content if isinstance(content, str) else "\n".join(
                _block_text(part, f"messages[{i}].content") for part in content or ())
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(f"messages[{i}]: {role} content blocks of type {kind!r} are not supported (text, "
                           "tool_use, tool_result, thinking)", "messages")
    out = results[:]
    if texts or calls or not results:
        out.append({"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise APIError(f"{where}: expected a text block {{'type': 'text', 'text': ...}}, got {block!r:.80}",
                       where.split("[")[0].split(".")[0])
    return block["text"]


def _chat_tool(i: int, tool: Any) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None,
                                                                                                         "custom"):
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
    raise APIError(f"tool_choice.type must be auto, any, tool or none, got {kind!r:.50}", "tool_choice")


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
