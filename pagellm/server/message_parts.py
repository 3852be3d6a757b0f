"""A conversation's parts as a client sent them, checked before they are parsed: Chat Completions' messages here,
and the helpers the Responses API's input items and the Messages API's messages and system blocks use too.

Every error names the part's path, which is also its `param`:

    messages[2].content[1]: image input is not supported by this model; send text
    messages[0].role: unknown role 'robot' (system, user, assistant, tool, developer)
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from pagellm.server.errors import APIError, clip

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Part types that carry another modality, in any of the three APIs: what their error calls the input
MODALITIES = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
              "audio_url": "audio", "audio": "audio", "file": "file", "input_file": "file", "document": "document",
              "video_url": "video", "video": "video"}
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


STRING = {"type": "string"}


def shape(required: tuple[str, ...] = (), **properties: dict) -> dict:
    """The JSON schema of an object with these properties, those `required` present: the declared shape of a part
    these modules check by hand (so the published schema says what they take)."""
    return {"type": "object", "properties": properties, "required": list(required)}


def json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def json_path(loc) -> str:
    """('messages', 2, 'content', 1) -> 'messages[2].content[1]'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def refuse(path: str, problem: str) -> APIError:
    """A 400 for the part at `path`, its param that path."""
    return APIError(f"{path}: {problem}", path)


def need_object(value: Any, path: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise APIError(f"{path} must be {what}, got {json_type(value)}", path)
    return value


def need_string(item: dict, name: str, path: str, required: bool = True) -> str | None:
    """item[name]: a string (or absent / null when not required); APIError naming path.name otherwise."""
    value = item.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        problem = "is required (a string)" if value is None else f"must be a string, got {json_type(value)}"
        raise APIError(f"{path}.{name} {problem}", f"{path}.{name}")
    return value


def check_role(message: dict, path: str, roles: tuple[str, ...], hint: str = "") -> str:
    role = message.get("role")
    if role is None:
        raise APIError(f"{path}.role is required ({', '.join(roles)})", f"{path}.role")
    if not isinstance(role, str):
        raise APIError(f"{path}.role must be a string ({', '.join(roles)}), got {json_type(role)}", f"{path}.role")
    if role not in roles:
        raise APIError(f"{path}.role: unknown role {clip(role)} ({', '.join(roles)}){hint}", f"{path}.role")
    return role


def part_type(part: Any, path: str, known: tuple[str, ...], what: str = "content part") -> str:
    """The type of a content part (or block, or item) the server takes; a 400 naming the part for one of another
    modality, of a type it does not know, or one that is not an object."""
    need_object(part, path, f"a {what} object {{'type': ..., ...}}")
    kind = part.get("type")
    if kind in known:
        return kind
    if kind is None:
        raise APIError(f"{path}.type is required ({', '.join(known)})", f"{path}.type")
    if isinstance(kind, str) and kind in MODALITIES:
        raise refuse(path, f"{MODALITIES[kind]} input is not supported by this model; send text")
    shown = clip(kind) if isinstance(kind, str) else json_type(kind)
    raise refuse(path, f"{what}s of type {shown} are not supported ({', '.join(known)})")


def check_chat_messages(messages: Any, field: str = "messages") -> None:
    """Chat Completions messages as sent: a non-empty list of objects with a known role and text content (a
    string or text parts); the first problem is a 400 naming its path. The rest is pydantic's (ChatMessage)."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else json_type(messages)
        raise APIError(f"{field} must be a non-empty list of messages {{'role': ..., 'content': ...}}, got {got}",
                       field)
    for i, message in enumerate(messages):
        path = f"{field}[{i}]"
        need_object(message, path, "a message object {'role': ..., 'content': ...}")
        role = check_role(message, path, CHAT_ROLES)
        content = message.get("content")
        # A null or missing content is empty text on every role, as vLLM and llama-server take it: OpenAI's own
        # answers carry null content (a reply that only called tools, or only thought), sent back as history.
        if isinstance(content, list):
            for j, part in enumerate(content):
                part_type(part, f"{path}.content[{j}]", ("text",))
                need_string(part, "text", f"{path}.content[{j}]")
        elif content is not None and not isinstance(content, str):
            raise APIError(f"{path}.content must be a string or a list of content parts, got "
                           f"{json_type(content)}", f"{path}.content")
        if role == "tool":
            need_string(message, "tool_call_id", path)


# What chat's tools take (tool_calls.py checks them)
CHAT_TOOLS = {"type": "array", "items": shape(("type", "function"), type={"const": "function"}, function=shape(
    ("name",), name={"type": "string", "minLength": 1}, description=STRING, parameters={"type": "object"}))}


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


class _Message(BaseModel):
    """One chat message; the role's own class says what else it must carry, so the published schema does too."""

    model_config = ConfigDict(extra="ignore")
    name: StrictStr | None = None
    content: StrictStr | list[TextPart] | None = None  # None: empty text (check_chat_messages says why)

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        # The template has no notion of "developer": it is the system prompt under its new name.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if getattr(self, "tool_calls", None):
            # Templates write arguments with `| tojson`: an object, or they would quote the JSON text again.
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if getattr(self, "tool_call_id", None) is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class SystemMessageParam(_Message):
    role: Literal["system"]


class DeveloperMessageParam(_Message):
    role: Literal["developer"]


class UserMessageParam(_Message):
    role: Literal["user"]


class AssistantMessageParam(_Message):
    role: Literal["assistant"]
    tool_calls: list[MessageToolCall] | None = None  # its earlier calls


class ToolMessageParam(_Message):
    role: Literal["tool"]
    tool_call_id: StrictStr  # the call it answers


ChatMessage = Annotated[SystemMessageParam | DeveloperMessageParam | UserMessageParam | AssistantMessageParam
                        | ToolMessageParam, Field(discriminator="role")]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
