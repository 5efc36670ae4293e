"""Request ids and the middleware that gives every request one (``x-request-id``) and its record."""

from __future__ import annotations

import itertools
import os
import re
from typing import Any

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.request_record import RequestRecord

__all__ = ["REQUEST_ID_HEADER", "RequestIds", "plane_id"]

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,100}$")
# Request ids: this process's random prefix and a counter (as unique as a uuid4, without a syscall).
_PROCESS_ID = os.urandom(8).hex()
_sequence = itertools.count()


def plane_id(request_id: str) -> str:
    """The id of one request on the request plane: unique even when a client reuses its x-request-id."""
    return f"{request_id}.{_PROCESS_ID[:8]}{next(_sequence):x}"


class RequestIds:
    """Pure ASGI middleware: choose the request id, expose it as ``request.state.request_id``,
    echo it in ``x-request-id``, keep the request's ``RequestRecord`` in ``request.state.record``
    and close it (log line + metrics) when the response is over; unbind the logging context."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        record = RequestRecord(request_id, scope.get("path", ""), self.metrics)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["record"] = record
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())
        response: dict[str, Any] = {"status": None, "complete": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
                response["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["complete"] = True
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                record.finish(response["status"], body_complete=response["complete"])


def _request_id(scope: Scope) -> str:
    """An incoming ``x-request-id`` when it is a sane token, else a fresh one."""
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER.encode():
            text = bytes(value).decode("latin-1")
            if _REQUEST_ID.match(text):
                return text
    return f"{_PROCESS_ID}{next(_sequence):016x}"
