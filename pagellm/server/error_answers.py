"""The app's exception handlers: APIError, Starlette's HTTP errors and anything unhandled, as error bodies."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.server.errors import APIError, error_body_for

logger = logging.getLogger("pagellm.server")


def add_error_handlers(app: FastAPI) -> None:
    """Every error as a JSON body naming what went wrong: OpenAI's shape, Anthropic's under /v1/messages (401s
    too: guards.py); an unhandled exception a 500 that says what it was (and is logged), never a bare traceback."""
    def answer(request: Request, status: int, message: str, kind: str, param: str | None = None,
               headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body_for(request.url.path, status, message, kind, param), status_code=status,
                            headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        # A 429 says when to come back: the queue drains as requests finish, within seconds.
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {"Retry-After": "1"} \
            if exc.status == 429 else None
        return answer(request, exc.status, exc.message, exc.kind, exc.param, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = APIError._TYPES.get(exc.status_code, "invalid_request_error")
        return answer(request, exc.status_code, str(exc.detail), kind, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, 400, str(exc), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return answer(request, 500, f"internal error: {exc}", "internal_server_error")
