"""Tool calling: what `tool_choice` asks of the output, and tool calls parsed out of the model's text.

    tool_choice "none"      tools are left out of the prompt; the answer is text
    tool_choice "auto"      tools go to the chat template; calls are parsed out of the answer in the model's format
    tool_choice "required"  the answer is held (grammar) to a JSON array of one or more {"name", "arguments"}
    tool_choice {function}  the answer is held to that function's parameters schema: it is the arguments

Formats parsed under "auto", chosen from the chat template (or `serve --tool-call-parser`), as vLLM's parsers:
    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen 2.5 / 3, many others)
    llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>   (Llama 3.1+)
    pythonic     [get_weather(city="Paris"), ...]   (Gemma 3, Llama 4)
Streaming, text before a call streams as content; a call is sent whole in one delta.tool_calls when the answer
ends (OpenAI's clients join argument pieces, so one piece is valid).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from pagellm.config import TOOL_CALL_PARSERS
from pagellm.sampling_params import StructuredOutputs
from pagellm.server.errors import APIError, clip, shown

PARSERS = TOOL_CALL_PARSERS
_HERMES_START, _HERMES_CALL = "<tool_call>", re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"


def parser_for_template(template: str) -> str:
    if _HERMES_START in template:
        return "hermes"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "pythonic"


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function, when named

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def check_tools(tools: list | None, tool_choice) -> tuple[list[dict], ToolChoice]:
    """The tools as the template takes them and what tool_choice asks; APIError(400) naming the field."""
    tools = tools or []
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"...}}}}", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[function["name"]] = function
    choice = _tool_choice(tool_choice, tools)
    if choice.name is not None and choice.name not in functions:
        raise APIError(f"tool_choice names {clip(choice.name)}, which is not among the tools "
                       f"({shown(sorted(functions))})",
                       "tool_choice")
    if choice.mode != "none" and not tools and tool_choice is not None:
        raise APIError(f"tool_choice {tool_choice!r:.100} needs tools", "tool_choice")
    return tools, choice


def _tool_choice(value, tools: list) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        else None
    if not isinstance(name, str):
        raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
    return ToolChoice("named", name)


def forced_grammar(tools: list[dict], choice: ToolChoice, parallel: bool = True) -> StructuredOutputs | None:
    """The grammar a forced choice holds the answer to (None when nothing is forced); `parallel` false (the
    request's parallel_tool_calls): one call at most, so the model stops after it."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice.mode == "named":
        return StructuredOutputs(json=schemas[choice.name])
    if choice.mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        bounds = {"minItems": 1} if parallel else {"minItems": 1, "maxItems": 1}
        return StructuredOutputs(json={"type": "array", **bounds, "items": {"anyOf": calls}})
    return None


def tool_call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_forced(text: str, choice: ToolChoice) -> list[dict]:
    """The calls of an answer held to forced_grammar (an answer cut short by max_tokens may not parse: none)."""
    if choice.mode == "named":
        return [tool_call(choice.name, text)]
    try:
        return [tool_call(c["name"], c["arguments"]) for c in json.loads(text)]
    except (json.JSONDecodeError, TypeError, KeyError):
        return []


def parse_auto(text: str, parser: str) -> tuple[str | None, list[dict]]:
    """(content left, tool calls) of an answer under tool_choice "auto"; text that does not parse stays content."""
    if parser == "hermes":
        start = text.find(_HERMES_START)
        if start < 0:
            return text, []
        calls = [_json_call(body) for body in _HERMES_CALL.findall(text[start:])]
        if not calls or None in calls:
            return text, []
        return (text[:start].strip() or None), calls
    if parser == "llama3_json":
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        calls = [_json_call(part) for part in body.split(";")] if body.startswith("{") else [None]
        return (None, calls) if None not in calls else (text, [])
    calls = _pythonic_calls(text.strip())
    return (None, calls) if calls else (text, [])


def _json_call(body: str) -> dict | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return tool_call(call["name"], arguments)


def _pythonic_calls(text: str) -> list[dict]:
    """[f(a=1), g(b="x")]: a Python list of calls with literal keyword arguments; [] when it is anything else."""
    if not (text.startswith("[") and text.endswith("]")):
        return []
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return []
        calls.append(tool_call(node.func.id, arguments))
    return calls


class ToolCallStream:
    """One streamed answer: content deltas pass until a call may have begun; the rest is held and parsed at the
    end. feed() returns (content delta, tool calls to send now)."""

    def __init__(self, choice: ToolChoice, parser: str):
        self._choice, self._parser = choice, parser
        self._held = ""
        self._holding = choice.forced  # a forced answer is all call
        self._is_content = False  # llama3_json / pythonic: the answer began with text, not a call

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self._holding:
            self._held += text
            return self._end("", final)
        if self._is_content:
            return text, []
        text, self._held = self._held + text, ""
        if self._parser == "hermes":
            start = text.find(_HERMES_START)
            if start >= 0:
                self._holding, self._held = True, text[start:]
                return self._end(text[:start], final)
            keep = 0 if final else _marker_tail(text)
            self._held = text[len(text) - keep:]
            return text[:len(text) - keep], []
        # llama3_json, pythonic: an answer that calls begins with the call (after spaces)
        head = text.lstrip()
        openers = ("{", _PYTHON_TAG) if self._parser == "llama3_json" else ("[",)
        if head.startswith(openers):
            self._holding, self._held = True, text
            return self._end("", final)
        if not final and (not head or any(o.startswith(head) for o in openers)):
            self._held = text  # undecided: only spaces, or the start of "<|python_tag|>"
            return "", []
        self._is_content = True
        return text, []

    def _end(self, content: str, final: bool) -> tuple[str, list[dict]]:
        if not final:
            return content, []
        if self._choice.forced:
            return content, parse_forced(self._held, self._choice)
        rest, calls = parse_auto(self._held, self._parser)
        return (content, calls) if calls else (content + self._held, [])


def _marker_tail(text: str) -> int:
    """Characters at the end of `text` held back because they may begin "<tool_call>"."""
    for size in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
        if _HERMES_START.startswith(text[-size:]):
            return size
    return 0
