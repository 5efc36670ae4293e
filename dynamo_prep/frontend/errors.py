"""Every failure a client can see: its HTTP status, decided here once, and its body in the shape
the serving surface chose (``ErrorShape``; OpenAI's error body unless a surface brings its own).

Handlers raise ``OpenAIError``; the preprocessor's and the request plane's own exceptions are
mapped here once (``as_openai_error``), so the status a client gets for a given cause is decided
in one place: client mistakes are 4xx with the preprocessor's message, a worker's contract
refusal is a 400 with the engine's words, a pool with nobody to serve is 503, and nothing a
client sends ends as a 500.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from starlette.responses import Response

from dynamo_prep.frontend.client import NoSocketLeft, SlowReader, WorkerError, WorkerLost
from dynamo_prep.preprocessor import PreprocessError
from dynamo_prep.protocol.openai import ErrorBody, ErrorDetail, RequestError
from dynamo_prep.tokenizer import TokenizerError

__all__ = [
    "OPENAI_ERRORS",
    "REQUEST_ERRORS",
    "ErrorShape",
    "OpenAIError",
    "as_openai_error",
    "error_event",
    "error_response",
]

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_encoder = msgspec.json.Encoder()


class OpenAIError(Exception):
    """An HTTP error with OpenAI's body; ``param`` names the offending request field when known,
    ``retry_after_s`` goes into a ``Retry-After`` header (a 503 that will pass)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorBody:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorBody(
            error=ErrorDetail(message=self.message, type=kind, param=self.param, code=self.status)
        )


REQUEST_ERRORS = (
    OpenAIError, PreprocessError, RequestError, WorkerError, WorkerLost, SlowReader, TokenizerError
)  # fmt: skip
"""The exceptions a request may end with that ``as_openai_error`` maps to a 4xx/5xx answer."""


def as_openai_error(exc: BaseException) -> OpenAIError:
    """The client-facing form of any failure of a request."""
    match exc:
        case OpenAIError():
            return exc
        case PreprocessError():
            return OpenAIError(400, exc.message, param=exc.param)
        case RequestError():
            return OpenAIError(400, str(exc), param=exc.param)
        case WorkerError() if exc.code == 400:
            return OpenAIError(400, f"the engine refused the request: {exc.message}")
        case WorkerError() if exc.code in (503, 504):
            return OpenAIError(exc.code, f"the worker could not serve the request: {exc.message}")
        case WorkerError():
            return OpenAIError(502, f"the worker failed ({exc.code}): {exc.message}")
        case NoSocketLeft():
            return OpenAIError(503, "the frontend is at its open-socket limit; try again later")
        case WorkerLost():
            return OpenAIError(
                503,
                f"the worker serving this request was lost ({exc.reason}) and no instance could take over",
            )
        case SlowReader():
            return OpenAIError(408, f"the client did not read the stream in time: {exc}")
        case TokenizerError():
            return OpenAIError(502, f"the worker returned tokens this model cannot decode: {exc}")
    return OpenAIError(500, "internal error")


@dataclass(frozen=True)
class ErrorShape:
    """How a surface writes a failure's body; the status (and ``Retry-After``) stay this module's."""

    body: Callable[[OpenAIError], bytes]
    media_type: str = "application/json"


OPENAI_ERRORS = ErrorShape(lambda error: _encoder.encode(error.body()))
"""OpenAI's ``{"error": {"message", "type", "param", "code"}}``: the shape of every OpenAI surface."""


def error_response(
    error: OpenAIError, headers: dict[str, str] | None = None, shape: ErrorShape = OPENAI_ERRORS
) -> Response:
    if error.retry_after_s is not None:
        headers = {**(headers or {}), "retry-after": str(error.retry_after_s)}
    return Response(shape.body(error), status_code=error.status, media_type=shape.media_type, headers=headers)


def error_event(error: OpenAIError) -> bytes:
    """A streamed failure: one SSE ``data: {"error": {...}}`` event (the stream then ends)."""
    return b"data: " + _encoder.encode(error.body()) + b"\n\n"
