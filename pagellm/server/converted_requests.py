"""Requests in other APIs' envelopes (/v1/responses, /v1/messages, /v1/embeddings, /infill): their extra fields
checked, and the chat request a conversation becomes validated as chat's, with the outer API's field names."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import PrivateAttr

from pagellm.server.errors import APIError, shown
from pagellm.server.protocol import ChatCompletionRequest, parse_request


class ConvertedChatRequest(ChatCompletionRequest):
    """The chat request another API's request became (/v1/responses, /v1/messages): its unknown_fields() are the
    outer request's, which the server logs as it does chat's own."""

    _outer_unknown: tuple[str, ...] = PrivateAttr(default=())
    _outer_names: tuple = PrivateAttr(default=({}, ()))  # (chat field -> outer field, chat message -> outer part)

    def unknown_fields(self) -> list[str]:
        return sorted(set(super().unknown_fields()) | set(self._outer_unknown))

    def in_outer_words(self, exc: APIError) -> APIError:
        """An error found past parsing (the template, the context length, the engine) in the outer API's words."""
        return _in_outer_words(exc, *self._outer_names)


def parse_converted(chat: dict[str, Any], model: type[ConvertedChatRequest], field_names: dict[str, str],
                    outer_unknown: tuple[str, ...], origins: list[str] = ()) -> ConvertedChatRequest:
    """The chat request another API's request became, validated as chat's; an error names the outer API's field,
    in its param and its message (`field_names`: chat field -> outer field; `origins`: chat message i -> the
    outer part it came from), and the outer request's unknown fields travel with it."""
    try:
        converted = parse_request(json.dumps(chat).encode(), model)
    except APIError as exc:
        raise _in_outer_words(exc, field_names, origins) from None
    converted._outer_unknown = outer_unknown
    converted._outer_names = (field_names, tuple(origins))
    return converted


def _in_outer_words(exc: APIError, field_names: dict[str, str], origins: tuple[str, ...]) -> APIError:
    exc.message = outer_words(exc.message, field_names, origins)
    exc.param = outer_words(exc.param, field_names, origins) if exc.param is not None else None
    return exc


def outer_words(text: str, field_names: dict[str, str], origins: list[str] = ()) -> str:
    """`text` with chat's field names as the outer API's: messages[i] as the part it came from, then each name."""
    def origin(match: re.Match) -> str:
        i = int(match.group(1))
        return origins[i] if i < len(origins) else match.group(0)

    def rename(words: str) -> str:
        words = re.sub(r"\bmessages\[(\d+)\]", origin, words)
        for chat_name, outer_name in field_names.items():
            words = re.sub(rf"(?<![\w.])\b{chat_name}\b", outer_name, words)
        return words

    # the server's words only: a quoted string is the client's own value (a tool named 'stop' stays 'stop')
    pieces = _QUOTED.split(text)
    return "".join(piece if i % 2 else rename(piece) for i, piece in enumerate(pieces))


# a quote opens only where a word does not precede it: the apostrophe of "model's" opens nothing
_QUOTED = re.compile(r"""((?<!\w)'(?:[^'\\]|\\.)*'|(?<!\w)"(?:[^"\\]|\\.)*")""")


def check_outer_fields(extra: dict[str, Any] | None, refused: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """Another API's fields beyond its model's: a 400 naming one that would change the output and is not honoured
    (`refused`: name -> whether a value asks for nothing); the names nobody knows, ignored (and logged)."""
    unknown = []
    for name, value in (extra or {}).items():
        if name in refused:
            if not refused[name](value):
                raise APIError(f"{name} is not supported (got {shown(value)}); leave it out", name)
        elif name not in known:
            unknown.append(name)
    return tuple(sorted(unknown))
