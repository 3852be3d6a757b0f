"""The app's exception handlers: APIError, Starlette's HTTP errors and anything unhandled, as error bodies."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.server import messages_api
from pagellm.server.errors import APIError, error_body

logger = logging.getLogger("pagellm.server")


def add_error_handlers(app: FastAPI) -> None:
    """Every error as a JSON body naming what went wrong: OpenAI's shape, Anthropic's under /v1/messages; an
    unhandled exception a 500 that says what it was (and is logged), never a bare traceback."""
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        # A 429 says when to come back: the queue drains as requests finish, within seconds.
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {"Retry-After": "1"} \
            if exc.status == 429 else None
        body = messages_api.error_body(exc.message, exc.kind, exc.param) \
            if request.url.path.startswith("/v1/messages") else exc.body()
        return JSONResponse(body, status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = APIError._TYPES.get(exc.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc}", "internal_server_error"), status_code=500)
