"""Error answers: OpenAI's {"error": {"message", "type", "param", "code"}} with an HTTP status, and Anthropic's
{"type": "error", "error": {"type", "message"}} for its clients under /v1/messages."""

from __future__ import annotations

MAX_ECHOED_CHARS = 64  # a client's string quoted in an error or a log line is cut to this many characters
MESSAGES_PREFIX = "/v1/messages"  # Anthropic's Messages API: its clients parse its own error shape
# Anthropic's names where they differ from OpenAI's (its SDKs pick the exception by status; the name is what a
# user reads)
_ANTHROPIC_KINDS = {413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable_error"}

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind = kind or self._TYPES.get(status, "internal_server_error")

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param)


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_body_for(path: str, status: int, message: str, kind: str, param: str | None = None) -> dict:
    """The body a client of `path` parses: Anthropic's shape under /v1/messages (`param` kept beside the message,
    the field every pagellm 400 names), OpenAI's elsewhere."""
    if path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/"):
        return {"type": "error", "error": {"type": _ANTHROPIC_KINDS.get(status, kind), "message": message,
                                           "param": param}}
    return error_body(message, kind, param)


def clip(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """`text` quoted for an error or a log line, cut to `limit` characters with how many more there were: the
    strings come from clients, and a megabyte-long one must not come back whole."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text) - limit} more characters)"


def shown(value: object) -> str:
    """A client's value (any JSON) for an error: a string quoted and cut as clip() cuts it, anything else as
    Python writes it, cut the same way."""
    if isinstance(value, str):
        return clip(value)
    text = repr(value)
    extra = len(text) - MAX_ECHOED_CHARS
    return text if extra <= 0 else f"{text[:MAX_ECHOED_CHARS]}... ({extra} more characters)"
