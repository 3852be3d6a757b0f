"""Chat templates rendered as HF transformers renders them, without importing transformers.

Why here: the tokenizer no longer goes through transformers at run time (loader/tokenizer.py), and a template
is Jinja run in a sandbox with a few helpers. The environment mirrors transformers' apply_chat_template: an
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks and the loop controls, `tojson` without HTML
escaping, `raise_exception`, `strftime_now`, a `dict` and a `namespace` that refuse underscore names; the
messages and variables reduced to plain JSON data (keys whose value is None dropped), the reasoning aliased
under its three names, and the special tokens (bos_token, eos_token, ...) as variables. Token-for-token
agreement with transformers is tested on every template we ship or meet (tests/loader/test_chat_template.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


def compile_template(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    return environment.from_string(template)


def render(template: jinja2.Template, messages: list[dict[str, Any]], add_generation_prompt: bool,
           special_tokens: Mapping[str, str], **kwargs: Any) -> str:
    """The prompt text of a conversation; kwargs are the template's variables (tools, enable_thinking, ...)."""
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
    variables = _plain({**special_tokens, **kwargs})
    return template.render(messages=_alias_reasoning(_plain(chat)), tools=_plain(tools), documents=_plain(documents),
                           add_generation_prompt=add_generation_prompt, **variables)


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name a template may read it by (`thinking` for gpt-oss's)."""
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        aliased.append(message if reasoning is None else {"thinking": reasoning, **message,
                                                          "reasoning_content": reasoning})
    return aliased


def _plain(value: Any) -> Any:
    """JSON data only: a template sees no object whose methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which a prompt must keep as they are
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(form: str) -> str:
    return datetime.now().strftime(form)


class _TemplateDict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore names (no reach into Python internals)."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: namespace(self=...) stays possible
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")
