"""Non-streamed request kinds on the worker's request plane: each ``Call`` is decoded as the kind
its ``method`` names and answered by that kind's handler with one ``Answer`` (or an ``ErrorReply``).
docs/request-plane.md, "Adding a request kind".
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
import zmq

from dynamo_prep.protocol import wire
from dynamo_prep.protocol.calls import Echo, Echoed
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.decode import WireDecodeError
from dynamo_prep.protocol.wire import Answer, Call, Cancel, ErrorReply, Unary
from dynamo_prep.worker.generate import Reply

__all__ = ["CallError", "CallServer", "echo"]

log = structlog.get_logger("dynamo_prep.worker")

CancelHandler = Callable[[Cancel, Reply], Awaitable[None]]
_K = TypeVar("_K", bound=Unary[Any])


class CallError(Exception):
    """Raised by a handler: the call is answered with an ``ErrorReply`` of ``code`` (HTTP-like)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message


class CallServer:
    """Serves ``Call``: one task per call (the receive loop never waits on a handler), bounded by its
    deadline, stopped by a ``Cancel`` of its ``request_id`` and by ``drain``."""

    def __init__(self) -> None:
        self._kinds: dict[str, tuple[type[Any], Callable[[Any], Awaitable[Any]]]] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self.draining = False

    def register(self, kind: type[_K], handler: Callable[[_K], Awaitable[Any]]) -> None:
        """Answer every ``Call`` of ``kind.method`` with ``handler``'s result (a ``kind.answer``)."""
        self._kinds[kind.method] = (kind, handler)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def on_call(self, message: Call, reply: Reply) -> None:
        """Start the call's task, unless it must be refused (400, 503, 504)."""
        started = self._start(message)
        if isinstance(started, ErrorReply):
            await reply(started)
            return
        request_id = message.request_id
        task = asyncio.create_task(self._run(message, started, reply), name=f"call-{request_id}")
        self._running[request_id] = task
        task.add_done_callback(lambda _: self._forget(request_id, task))

    def cancelling(self, fallback: CancelHandler | None) -> CancelHandler:
        """A ``Cancel`` handler: it stops the call of that ``request_id``, else asks ``fallback``
        (the generation server's)."""

        async def on_cancel(message: Cancel, reply: Reply) -> None:
            task = self._running.pop(message.request_id, None)  # gone: its task answers nothing
            if task is not None:
                task.cancel()
            elif fallback is not None:
                await fallback(message, reply)

        return on_cancel

    async def drain(self, timeout_s: float) -> None:
        """Refuse new calls (503), let those in flight finish for ``timeout_s``, then cancel the
        rest (each answered with a 503: retryable elsewhere)."""
        self.draining = True
        tasks = list(self._running.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(request_id) is task:
            del self._running[request_id]

    def _start(self, message: Call) -> ErrorReply | Callable[[], Awaitable[Any]]:
        """The refusal of a call that must not start, or its handler bound to its request."""
        request_id = message.request_id
        known = self._kinds.get(message.method)
        if known is None:
            return ErrorReply(request_id=request_id, code=400, message="unsupported request")
        if self.draining:
            return ErrorReply(request_id=request_id, code=503, message="worker is draining")
        if request_id in self._running:
            return ErrorReply(request_id=request_id, code=400, message="duplicate request_id")
        if message.deadline_ms <= now_ms():
            late = "deadline passed before the request started"
            return ErrorReply(request_id=request_id, code=504, message=late)
        kind, handler = known
        try:
            request = wire.decode_body(message.body, kind)
        except WireDecodeError as exc:
            log.warning("request_rejected", reason=exc.reason, kind=message.method, error=exc.detail[:200])
            return ErrorReply(request_id=request_id, code=400, message="invalid request")
        return functools.partial(handler, request)

    async def _run(self, message: Call, answering: Callable[[], Awaitable[Any]], reply: Reply) -> None:
        request_id = message.request_id
        final: Answer | ErrorReply
        try:
            async with asyncio.timeout(message.deadline_ms / 1000 - time.time()) as scope:
                answer = await answering()
            final = Answer(request_id=request_id, body=wire.encode_body(answer))
        except TimeoutError:
            if not scope.expired():
                raise
            final = ErrorReply(request_id=request_id, code=504, message="deadline passed")
        except asyncio.CancelledError:
            if self._running.get(request_id) is not asyncio.current_task():  # the frontend's Cancel
                raise
            final = ErrorReply(
                request_id=request_id, code=503, message="worker stopped before the request finished"
            )
        except CallError as exc:
            final = ErrorReply(request_id=request_id, code=exc.code, message=exc.message)
        except Exception as exc:
            log.exception("request_failed", kind=message.method, request_id=request_id)
            final = ErrorReply(request_id=request_id, code=500, message=type(exc).__name__)
        try:
            await reply(final)
        except zmq.ZMQError as exc:  # the request plane closed: the worker is stopping anyway
            log.debug("reply_dropped", request_id=request_id, error=str(exc))


async def echo(request: Echo) -> Echoed:
    """``Echo``'s handler, on every worker."""
    return Echoed(data=request.data)
