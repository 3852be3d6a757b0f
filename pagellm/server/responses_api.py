"""OpenAI's Responses API (POST /v1/responses), stateless: a request becomes a chat request, and the chat answer
(text, reasoning, tool calls: server/responses.py's ChatFormatter) becomes Responses output items and events.

Why through chat: the chat path already renders templates, splits reasoning, parses tool calls and compiles
structured output; the Responses API is another envelope around the same turn. The mapping:

    input (string or items)   -> messages: message items by role, function_call items -> an assistant message's
                                 tool_calls, function_call_output -> a tool message; instructions -> a system one
    max_output_tokens         -> max_completion_tokens;  text.format -> response_format
    tools (flat functions)    -> chat tools;  tool_choice {"type": "function", "name"} -> chat's named choice
    reasoning.effort          -> template variables reasoning_effort (and enable_thinking false for "none")

Nothing is stored: `store: true` and `previous_response_id` are a 400 naming the field (a client keeps the
conversation and sends it as input items, as the stateless mode of the API expects).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, StrictBool, StrictStr, WithJsonSchema

from pagellm.server.errors import APIError, shown
from pagellm.server.converted_requests import ConvertedChatRequest, check_outer_fields, parse_converted
from pagellm.server.message_parts import (STRING, check_role, json_type, need_object, need_string, part_type,
                                          shape)
from pagellm.server.protocol import Int, ServiceTier, absent, one_of, parse_request
from pagellm.server.responses import ChatFormatter
from pagellm.server.streaming import typed_event

# chat field -> the Responses field a client sent it as, for error bodies
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "chat_template_kwargs": "reasoning"}
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "parallel_tool_calls", "user", "logit_bias", "stop", "ignore_eos")
# Responses fields that would change the answer and are not honoured: name -> whether a value asks for nothing
# (top_logprobs: the logprobs of output_text, which need `include` too)
_REFUSED = {"background": absent, "conversation": one_of(), "prompt": one_of(), "include": absent,
            "max_tool_calls": one_of(), "truncation": one_of("disabled"), "top_logprobs": absent}
_ROLES = ("user", "assistant", "system", "developer")
_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text")
# The declared shapes of what _messages and _chat_tool check by hand
NAME = {"type": "string", "minLength": 1}
_CONTENT = {"anyOf": [STRING, {"type": "array", "items": shape(("type", "text"), type={"enum": list(_TEXT_PARTS)},
                                                                 text=STRING)}]}
_INPUT = {"anyOf": [STRING, {"type": "array", "items": {"anyOf": [
    shape(("role", "content"), type={"const": "message"}, role={"enum": list(_ROLES)}, content=_CONTENT),
    shape(("type", "call_id", "name", "arguments"), type={"const": "function_call"}, call_id=STRING, name=STRING,
          arguments=STRING),
    shape(("type", "call_id", "output"), type={"const": "function_call_output"}, call_id=STRING, output=_CONTENT),
    shape(("type",), type={"const": "reasoning"})]}}]}
_TOOLS = {"type": "array", "items": shape(("type", "name"), type={"const": "function"}, name=NAME,
                                          description=STRING, parameters={"type": "object"},
                                          strict={"type": "boolean"})}
_TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, shape(("type", "name"), type={"const": "function"},
                                                                          name=STRING), {"type": "null"}]}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # sampling extensions (top_k, seed, ...) pass on to chat

    model: StrictStr | None = None
    input: Annotated[StrictStr | list[Any], WithJsonSchema(_INPUT)]
    instructions: StrictStr | None = None
    max_output_tokens: Int(ge=1) | None = None
    stream: StrictBool = False
    tools: Annotated[list[Any], WithJsonSchema(_TOOLS)] | None = None
    tool_choice: Annotated[Any, WithJsonSchema(_TOOL_CHOICE)] = None
    text: dict[StrictStr, Any] | None = None
    reasoning: dict[StrictStr, Any] | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    # no effect on the output (bookkeeping, cache routing, stream obfuscation): typed, so a wrong type is a 400
    service_tier: ServiceTier | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: StrictStr | None = None
    stream_options: dict[StrictStr, StrictBool] | None = None
    _unknown: tuple[str, ...] = PrivateAttr(default=())  # fields nobody knows: ignored (logged by the server)

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise APIError("previous_response_id is not supported: this server stores no responses; send the "
                           "conversation as input items", "previous_response_id")
        if self.store:
            raise APIError("store is not supported: this server stores no responses; send store: false or leave "
                           "it out", "store")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise APIError(f"text.verbosity is not supported (got {shown(self.text['verbosity'])}); leave it out",
                           "text")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise APIError(f"reasoning.effort must be a string, got {json_type(effort)}", "reasoning")
        if (self.reasoning or {}).get("summary") is not None:
            raise APIError("reasoning.summary is not supported: reasoning comes back whole, as reasoning_text "
                           "content; leave summary out", "reasoning")
        self._unknown = check_outer_fields(self.model_extra, _REFUSED, frozenset(_PASSED))


class ResponsesChatRequest(ConvertedChatRequest):
    """The chat request a Responses request becomes; errors name the Responses fields."""

    @property
    def max_tokens_field(self) -> str:
        return "max_output_tokens"


def chat_request(raw: bytes) -> tuple[ResponsesRequest, ResponsesChatRequest]:
    """The request and its chat form; APIError(400) naming the Responses field."""
    request = parse_request(raw, ResponsesRequest)
    messages, origins = _messages(request)
    chat: dict[str, Any] = {"messages": messages, "stream": request.stream,
                            "max_completion_tokens": request.max_output_tokens}
    if request.model is not None:
        chat["model"] = request.model
    if request.stream:
        chat["stream_options"] = {"include_usage": True}  # the completed event carries usage
    for name in _PASSED:
        if name in (request.model_extra or {}):
            chat[name] = request.model_extra[name]
    if request.tools:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
    fmt = (request.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort, **({"enable_thinking": False}
                                                                       if effort == "none" else {})}
    return request, parse_converted(chat, ResponsesChatRequest, _FIELD_NAMES, request._unknown, origins)


def _messages(request: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """Chat messages of instructions and input, and beside each the part it came from (errors name that part)."""
    messages, origins = ([{"role": "system", "content": request.instructions}], ["instructions"]) \
        if request.instructions else ([], [])
    if isinstance(request.input, str):
        return messages + [{"role": "user", "content": request.input}], origins + ["input"]
    for i, item in enumerate(request.input):
        path = f"input[{i}]"
        kind = need_object(item, path, "an item object (a message, a function call or its output)").get("type",
                                                                                                     "message")
        if kind == "message":
            messages.append({"role": check_role(item, path, _ROLES), "content": _text(item, "content", path)})
        elif kind == "function_call":
            call = {"id": need_string(item, "call_id", path), "type": "function", "function": {
                "name": need_string(item, "name", path), "arguments": need_string(item, "arguments", path)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text and its calls: one assistant turn,
                last.setdefault("tool_calls", []).append(call)  # as the model wrote it (and chat renders it)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": need_string(item, "call_id", path),
                             "content": _text(item, "output", path)})
        elif kind != "reasoning":  # earlier reasoning is not shown to the template again
            part_type(item, path, _ITEMS, "input item")
        else:
            continue
        origins.append(path)
    if not messages:
        raise APIError("input must hold at least one message (or instructions be given)", "input")
    return messages, origins


def _text(item: dict, name: str, path: str) -> str:
    """A message's content or a call's output: a string, or its text parts joined."""
    content, path = item.get(name), f"{path}.{name}"
    if isinstance(content, str):
        return content
    if content is None:
        raise APIError(f"{path} is required (a string or a list of content parts)", path)
    if not isinstance(content, list):
        raise APIError(f"{path} must be a string or a list of content parts, got {json_type(content)}", path)
    texts = []
    for j, part in enumerate(content):
        part_type(part, f"{path}[{j}]", _TEXT_PARTS)
        texts.append(need_string(part, "text", f"{path}[{j}]"))
    return "\n".join(texts)


def _chat_tool(i: int, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(f"tools[{i}]: tools of type {shown(kind)} are not supported; function tools are", "tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(f"tools[{i}].name is required: a non-empty string", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str) or choice is None:
        return choice
    raise APIError(f"tool_choice {choice!r:.100} is not supported: use none, auto, required or "
                   "{'type': 'function', 'name': ...}", "tool_choice")


def _response_format(fmt: Any) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(f"text.format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {fmt!r:.100}",
                   "text")


class ResponsesFormatter:
    """The Responses envelope around a ChatFormatter: a response object, or its stream of typed events."""

    done_marker = ""  # a Responses stream ends with response.completed, no [DONE]

    def __init__(self, model_name: str, request: ResponsesRequest, chat: ChatFormatter):
        self.request_id = f"resp_{uuid.uuid4().hex}"
        self._model, self._request, self._chat = model_name, request, chat
        self._created = int(time.time())
        self._items: list[dict] = []  # output items as streamed so far
        self._open: dict[str, int] = {}  # kind ("reasoning", "message") -> index in _items of the open one
        self._sequence = 0
        self._finish_reason: str | None = None

    # ---- a whole response --------------------------------------------------------------------------------

    def response(self, outputs: list, usage_: dict) -> dict:
        message = self._chat.response(outputs, usage_)["choices"][0]["message"]
        items = []
        if message.get("reasoning_content"):
            items.append(self._reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            items.append(self._message_item(message["content"]))
        items += [self._call_item(call) for call in message.get("tool_calls") or ()]
        return self._object(items, outputs[0].outputs[0].finish_reason, usage_)

    def _object(self, items: list[dict], finish_reason: str | None, usage_: dict | None,
                status: str | None = None) -> dict:
        status = status or ("incomplete" if finish_reason == "length" else "completed")
        request = self._request
        return {"id": self.request_id, "object": "response", "created_at": self._created, "status": status,
                "error": None, "model": self._model, "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "parallel_tool_calls": (request.model_extra or {}).get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": request.reasoning or {"effort": None, "summary": None},
                "store": False, "temperature": (request.model_extra or {}).get("temperature"),
                "text": request.text or {"format": {"type": "text"}}, "tool_choice": request.tool_choice or "auto",
                "tools": request.tools or [], "top_p": (request.model_extra or {}).get("top_p"),
                "truncation": "disabled", "metadata": request.metadata or {},
                "usage": _usage(usage_) if usage_ is not None else None}

    @staticmethod
    def _reasoning_item(text: str) -> dict:
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    @staticmethod
    def _message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                "status": "completed"}

    # ---- a stream of events (api_server's _sse drives these) ---------------------------------------------

    event = staticmethod(typed_event)

    def first_chunks(self, num_choices: int, include_usage: bool) -> list[dict]:
        started = self._object([], None, None, status="in_progress")
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def chunk(self, index: int, output, include_usage: bool) -> list[dict]:
        chunk = self._chat.chunk(index, output, False)
        if chunk is None:
            return []
        delta, events = chunk["choices"][0]["delta"], []
        if delta.get("reasoning_content"):
            events += self._append("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._append("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._close_open()
            item = {**self._call_item(call), "arguments": "", "status": "in_progress"}
            self._items.append(item)
            at = len(self._items) - 1
            events.append(self._event("response.output_item.added", output_index=at, item=dict(item)))
            arguments = call["function"]["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=at, delta=arguments))
            item.update(arguments=arguments, status="completed")
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=at, arguments=arguments))
            events.append(self._event("response.output_item.done", output_index=at, item=item))
        self._finish_reason = chunk["choices"][0]["finish_reason"]
        return events

    def last_chunks(self, usage_: dict, include_usage: bool) -> list[dict]:
        events = self._close_open()
        # response.completed whatever the status (vLLM does the same): the official client's stream helper waits
        # for it, and an incomplete response says so in its status and incomplete_details
        return events + [self._event("response.completed", response=self._object(self._items, self._finish_reason,
                                                                                   usage_))]

    def _append(self, kind: str, text: str) -> list[dict]:
        """Text for the open item of `kind` (reasoning or message), opening it (and closing the other) first."""
        events = []
        if kind not in self._open:
            events += self._close_open()
            item = self._reasoning_item("") if kind == "reasoning" else self._message_item("", "in_progress")
            self._items.append(item)
            self._open[kind] = at = len(self._items) - 1
            events.append(self._event("response.output_item.added", output_index=at,
                                      item={**item, "content": []}))
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=at,
                                      content_index=0, part=dict(item["content"][0])))
        at = self._open[kind]
        item = self._items[at]
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=item["id"], output_index=at, content_index=0, delta=text, **extra))
        return events

    def _close_open(self) -> list[dict]:
        events = []
        for kind, at in sorted(self._open.items(), key=lambda entry: entry[1]):
            item, part = self._items[at], self._items[at]["content"][0]
            name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self._event(name, item_id=item["id"], output_index=at, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                      content_index=0, part=dict(part)))
            item["status"] = "completed"
            events.append(self._event("response.output_item.done", output_index=at, item=item))
        self._open.clear()
        return events

    def _event(self, kind: str, **fields: Any) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}


def _usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
