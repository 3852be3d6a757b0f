"""The OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations


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
