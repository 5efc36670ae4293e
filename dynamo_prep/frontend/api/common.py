"""What every API surface shares: the frontend's state (``Api``), a surface's route
(``SurfaceRoute``, carrying the surface's error shape), the body read within the limits, work moved
off the loop for large bodies, a client leaving, and the SSE response."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.frontend.config import HttpSettings
from dynamo_prep.frontend.errors import OPENAI_ERRORS, ErrorShape, OpenAIError
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.migration import Migration
from dynamo_prep.frontend.offload import off_loop_if_slow
from dynamo_prep.frontend.request_record import CLIENT_GONE, RequestRecord
from dynamo_prep.frontend.schema_checks import SchemaChecks
from dynamo_prep.protocol.openai import ChatCompletionRequest, decode_chat_shell, parse_chat_request

__all__ = [
    "JSON",
    "THREAD_ABOVE_BYTES",
    "Api",
    "EventStream",
    "PiecedResponse",
    "Surface",
    "SurfaceRoute",
    "drain",
    "encoder",
    "off_loop",
    "parse_chat",
    "read_body",
    "unless_disconnected",
]

log = structlog.get_logger("dynamo_prep.frontend")

# Preprocessing is sub-millisecond for ordinary prompts; bodies above this render and tokenize in a
# thread (~0.1 ms more), so one huge prompt cannot stall every other stream, nor /live, on the loop.
THREAD_ABOVE_BYTES = 32 << 10
JSON = "application/json"
encoder = msgspec.json.Encoder()
_T = TypeVar("_T")
_NO_CACHE = {"cache-control": "no-cache"}


@dataclass(frozen=True)
class Api:
    """The state every surface serves from (built once by ``app.create_app``)."""

    catalog: ModelCatalog
    migration: Migration
    settings: HttpSettings
    metrics: FrontendMetrics
    schemas: SchemaChecks

    def live_model(self, name: str) -> LiveModel:
        """The model if it can serve now; 503 while it (or every model) has no instance; else 404."""
        model = self.catalog.get(name)
        if model is not None:
            return model
        served = self.catalog.names()
        if self.catalog.status(name) == "pending":
            raise OpenAIError(503, f"model {name!r} has no live instance right now; retry shortly")
        if not served:
            raise OpenAIError(503, f"no model is being served right now (asked for {name!r})")
        raise OpenAIError(
            404, f"The model {name!r} does not exist. Served models: {', '.join(served)}", param="model"
        )

    def serving(self, record: RequestRecord, name: str) -> LiveModel:
        """The live model asked for, named in the request's record."""
        if self.catalog.status(name) != "unknown":
            record.name_model(name)
        model = self.live_model(name)
        record.serving(model.name)
        structlog.contextvars.bind_contextvars(model=model.name)
        return model


class Surface(Protocol):
    """An API surface: a module of ``api/`` with its routes."""

    def routes(self, api: Api) -> list[Route]: ...


class SurfaceRoute(Route):
    """A surface's route: a failure on it (a raised error, a wrong method) answers in ``errors``'s
    shape (``api/failures.py``); its status is still ``errors.py``'s."""

    def __init__(
        self,
        path: str,
        endpoint: Callable[[Request], Awaitable[Response]],
        method: str,
        errors: ErrorShape = OPENAI_ERRORS,
    ) -> None:
        super().__init__(path, endpoint, methods=[method])
        self.errors = errors

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["error_shape"] = self.errors
        await super().handle(scope, receive, send)


async def read_body(request: Request, settings: HttpSettings) -> bytes:
    """The body, refused with 413 past the size limit (by Content-Length, and as it streams in),
    with 408 when it takes longer than ``body_timeout_s``; a client leaving mid-upload is a 499."""
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"the request body took longer than {settings.body_timeout_s:g} s") from None
    except ClientDisconnect:
        raise OpenAIError(CLIENT_GONE, "client disconnected during the upload") from None
    return b"".join(chunks)


async def parse_chat(body: bytes) -> ChatCompletionRequest:
    """The chat request; a large body's messages are decoded in a thread, a part at a time."""
    if len(body) <= THREAD_ABOVE_BYTES:
        return parse_chat_request(body)
    return await asyncio.to_thread(decode_chat_shell(body).finish)


async def off_loop(size: int, work: Callable[[], _T]) -> _T:
    """``work()``, in a thread when the body is large or a render turns out slow (never long on the loop)."""
    return await off_loop_if_slow(work, in_thread=size > THREAD_ABOVE_BYTES)


async def drain(items: AsyncGenerator[Any, None]) -> None:
    async with contextlib.aclosing(items):
        async for _ in items:
            pass


async def unless_disconnected(receive: Receive, work: Awaitable[_T]) -> _T:
    """Await ``work``, cancelling it (and so the worker's generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        log.info("client_disconnected")
        raise OpenAIError(CLIENT_GONE, "client disconnected")
    return task.result()


class PiecedResponse(Response):
    """A response whose body is written piece by piece (its length announced first): a large
    answer is never joined into one copy."""

    def __init__(self, pieces: Sequence[bytes], media_type: str) -> None:
        self.pieces = pieces
        super().__init__(media_type=media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for piece in self.pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        super().init_headers(headers)
        length = str(sum(len(piece) for piece in self.pieces)).encode()
        kept = [(name, value) for name, value in self.raw_headers if name != b"content-length"]
        self.raw_headers = [(b"content-length", length), *kept]


class EventStream(Response):
    """A ``text/event-stream`` response: each item of ``events`` is one body write, and a client
    that goes away cancels the stream (closing it cancels the generation on the worker); the
    response then never completes, which the request's record logs as 499."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(headers=_NO_CACHE)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            await unless_disconnected(receive, self._pump(send))
        except OpenAIError:  # the client left: nobody to answer
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        async with contextlib.aclosing(self.events):
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        super().init_headers(headers)
        self.raw_headers = [(name, value) for name, value in self.raw_headers if name != b"content-length"]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
