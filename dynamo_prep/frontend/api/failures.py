"""The app's exception handlers: a failure's status is ``errors.py``'s (decided there, once), its body
the shape of the surface whose route failed (``SurfaceRoute``; OpenAI's before any route matched),
and the request's record is told (its ``request_failed`` line is written when the response is over)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from dynamo_prep.frontend.errors import (
    OPENAI_ERRORS,
    REQUEST_ERRORS,
    ErrorShape,
    OpenAIError,
    as_openai_error,
    error_response,
)
from dynamo_prep.frontend.request_record import RequestRecord

__all__ = ["HANDLERS"]

log = structlog.get_logger("dynamo_prep.frontend")


async def _request_error(request: Request, exc: Exception) -> Response:
    """The error's answer; the ``request_failed`` line is written when the response is over."""
    error = as_openai_error(exc)
    _record_failure(request, error)
    return error_response(error, shape=_shape(request))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("request_crashed", path=request.url.path, error=repr(exc))
    error = OpenAIError(500, "internal error")
    _record_failure(request, error)
    return error_response(error, shape=_shape(request))


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 in the error body of the path's surface (OpenAI's for no surface)."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    headers = dict(exc.headers or {})
    error = OpenAIError(exc.status_code, message)
    _record_failure(request, error)
    return error_response(error, headers=headers, shape=_shape(request))


def _record_failure(request: Request, error: OpenAIError) -> None:
    record: RequestRecord | None = getattr(request.state, "record", None)
    if record is not None:
        record.fail(error.status, error.message)


def _shape(request: Request) -> ErrorShape:
    shape: ErrorShape = getattr(request.state, "error_shape", OPENAI_ERRORS)
    return shape


Handler = Callable[[Request, Exception], Awaitable[Response]]
HANDLERS: Mapping[type[Exception] | int, Handler] = {
    HTTPException: _http_exception,
    **dict.fromkeys(REQUEST_ERRORS, _request_error),
    Exception: _unexpected,
}
"""Starlette's ``exception_handlers``: every failure of a request, answered."""
