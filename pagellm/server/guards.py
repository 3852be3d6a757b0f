"""What every request passes before a route reads it: the API key (every route but /health) and a bounded body."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from fastapi import Request

from pagellm.server.errors import APIError, error_body_for

# /health: load balancers probe it without credentials; the chat page and its files hold no data (the page asks
# for the key and sends it with every call). Only files that exist: any other path under /static still needs a key
_STATIC = Path(__file__).parent / "static"
OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico",
                        *(f"/static/{path.relative_to(_STATIC).as_posix()}" for path in _STATIC.rglob("*")
                          if path.is_file())})


class ApiKeyMiddleware:
    """401 unless 'Authorization: Bearer <key>' or 'x-api-key: <key>' (Anthropic's clients send that) carries one
    of the keys. Every key is compared, in constant time, so the answer's timing tells nothing about which key or
    how much of one matched."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self._expected = [key.encode() for key in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-cased names (ASGI)
        bearer = headers.get(b"authorization", b"")
        sent = [bearer[len(b"Bearer "):] if bearer.startswith(b"Bearer ") else None, headers.get(b"x-api-key")]
        matched = False
        for expected in self._expected:
            for value in sent:  # both compared always: no timing difference between the headers either
                matched |= secrets.compare_digest(value or b"\0", expected)
        if matched:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body_for(scope["path"], 401, "invalid or missing API key: send 'Authorization: "
                                         "Bearer <key>' or 'x-api-key: <key>'", "authentication_error")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or APIError(413) as soon as it is known to exceed `limit` bytes (from Content-Length, or
    while it streams in): a client cannot make the server buffer or tokenize more than that."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
                    status=413)
