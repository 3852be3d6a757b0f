"""Requests in other APIs' envelopes (/v1/responses, /v1/messages, /v1/embeddings, /infill): their extra fields
checked, and the chat request a conversation becomes validated as chat's, with the outer API's field names."""

from __future__ import annotations

import json
from typing import Any

from pydantic import PrivateAttr

from pagellm.server.errors import APIError
from pagellm.server.protocol import ChatCompletionRequest, parse_request


class ConvertedChatRequest(ChatCompletionRequest):
    """The chat request another API's request became (/v1/responses, /v1/messages): its unknown_fields() are the
    outer request's, which the server logs as it does chat's own."""

    _outer_unknown: tuple[str, ...] = PrivateAttr(default=())

    def unknown_fields(self) -> list[str]:
        return sorted(set(super().unknown_fields()) | set(self._outer_unknown))


def parse_converted(chat: dict[str, Any], model: type[ConvertedChatRequest], field_names: dict[str, str],
                    outer_unknown: tuple[str, ...]) -> ConvertedChatRequest:
    """The chat request another API's request became, validated as chat's; an error names the outer API's field
    (`field_names`: chat field -> outer field), and the outer request's unknown fields travel with it."""
    try:
        converted = parse_request(json.dumps(chat).encode(), model)
    except APIError as exc:
        exc.param = field_names.get(exc.param, exc.param)
        raise
    converted._outer_unknown = outer_unknown
    return converted


def check_outer_fields(extra: dict[str, Any] | None, refused: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """Another API's fields beyond its model's: a 400 naming one that would change the output and is not honoured
    (`refused`: name -> whether a value asks for nothing); the names nobody knows, ignored (and logged)."""
    unknown = []
    for name, value in (extra or {}).items():
        if name in refused:
            if not refused[name](value):
                raise APIError(f"{name} is not supported (got {value!r:.100}); leave it out", name)
        elif name not in known:
            unknown.append(name)
    return tuple(sorted(unknown))
