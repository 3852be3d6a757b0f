"""Delivering an answer: one JSON response, or server-sent events, driven by a formatter
(server/responses.py, responses_api.py, messages_api.py); the client going away aborts its requests."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagellm.server.errors import APIError, error_body
from pagellm.server.responses import usage


async def collect(request: Request, stream: RequestStream, formatter, prompt_lens: list[int], n: int) -> Response:
    watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
    finals = {}
    try:
        async for index, output in stream:
            if output.finished:
                finals[index] = output
    except EngineDeadError as exc:
        raise APIError(str(exc), status=503) from None
    except RequestFailedError as exc:  # this request alone; the server goes on
        raise APIError(str(exc), status=exc.status) from None
    finally:
        watcher.cancel()
        stream.abort()
    if len(finals) < len(stream.request_ids):  # the client went away: nobody reads this
        return Response(status_code=499)
    outputs = [finals[i] for i in range(len(finals))]
    return JSONResponse(formatter.response(outputs, usage(prompt_lens, outputs, n)))


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.abort()
            return


class EventStream(StreamingResponse):
    """SSE response that aborts its requests however it ends, even before the first event is sent."""

    def __init__(self, content, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream")
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


async def sse(stream: RequestStream, formatter, prompt_lens: list[int], n: int, include_usage: bool):
    """Server-sent events; the client going away cancels this generator, which aborts the requests. A formatter
    may answer one engine output with several events (a list) and end with its own (last_chunks)."""
    finals = {}
    event = getattr(formatter, "event", _event)
    # how this API says a request failed mid-stream (Anthropic's clients skip an unnamed event)
    error_event = getattr(formatter, "error_event", lambda message, kind: _event(error_body(message, kind)))
    try:
        for chunk in formatter.first_chunks(len(stream.request_ids), include_usage):
            yield event(chunk)
        async for index, output in stream:
            if output.finished:
                finals[index] = output
            chunks = formatter.chunk(index, output, include_usage)
            for chunk in chunks if isinstance(chunks, list) else () if chunks is None else (chunks,):
                yield event(chunk)
        last = getattr(formatter, "last_chunks", None)
        if include_usage or last is not None:
            outputs = [finals[i] for i in range(len(finals))]
            total = usage(prompt_lens, outputs, n)
            for chunk in last(total, include_usage) if last else [formatter.usage_chunk(total)]:
                yield event(chunk)
    except EngineDeadError as exc:
        yield error_event(str(exc), "service_unavailable_error")
    except RequestFailedError as exc:
        yield error_event(str(exc), APIError(str(exc), status=exc.status).kind)
    finally:
        stream.abort()
    yield getattr(formatter, "done_marker", "data: [DONE]\n\n")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def typed_event(payload: dict) -> str:
    """An SSE event named by its payload's type (the Responses and Messages streams name every event)."""
    return f"event: {payload['type']}\n{_event(payload)}"
