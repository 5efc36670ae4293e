"""The frontend's side of the request plane: transport only (which instance, and what to do when
one is lost, is ``migration.py``'s policy).

One DEALER per worker endpoint carries every request to it; a single receive task per endpoint
routes replies to per-request queues by ``request_id``. A worker that dies says nothing, so each
endpoint has a watchdog: when a busy endpoint has been silent for a while it is pinged (a slow
worker still answers), and after ``stall_timeout_s`` of silence every request on it fails with
``WorkerLost``. The discovery watcher makes that immediate by calling ``endpoint_lost`` when an
instance expires. An endpoint that has never answered anything ``connect_timeout_s`` after its
first request is ``unreachable`` (a black-holed or forged announce): its requests fail at once, and
it is kept out of routing (``unreachable_endpoints``) until it answers or ``UNREACHABLE_HOLD_S``
passes.

An endpoint without requests for ``idle_close_s`` is closed by the same watchdog: a worker that
stopped gracefully is withdrawn, never expired, so nothing else would ever close its socket, its
two tasks and libzmq's reconnect attempts to its dead port. The next request reopens it.

Per message the cost is kept small: the receive task wakes once per batch of arrived replies and
drains them with the synchronous shadow socket (no Future per message); a request's consumer
takes everything queued for it at once, and consecutive Outputs are merged into one (token ids
concatenated, the last usage and finish reason), so a busy frontend handles a burst of tokens as
one step. The request's deadline is one timer, not a timeout per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio
from prometheus_client import Counter

from dynamo_prep.limits import is_exhausted
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import now_ms
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Cancel, ErrorReply, Generate, Output, Ping, Pong, merged

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "NoSocketLeft",
    "RequestPlaneClient",
    "WorkerError",
    "WorkerLost",
]

log = structlog.get_logger("dynamo_prep.frontend")

DEFAULT_STALL_TIMEOUT_S = 10.0
DEFAULT_IDLE_CLOSE_S = 30.0
# A worker answers a Ping within milliseconds; one that never answered anything this long after
# its first request is not there.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
UNREACHABLE_HOLD_S = 30.0
# Probes per stall timeout: a live worker gets several chances to answer a Ping before it is lost.
PROBES_PER_STALL = 4
# How long past its deadline the client waits for the worker's own "deadline" reply.
DEADLINE_GRACE_S = 1.0


class WorkerError(Exception):
    """The worker refused or failed the request (an ``ErrorReply``): 400 contract, 503 draining, ..."""

    def __init__(self, code: int, message: str, *, endpoint: str = "") -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message
        self.endpoint = endpoint


class WorkerLost(Exception):  # noqa: N818 - the name the frontend codes against
    """The worker died or was removed mid-request; the stream will not continue there."""

    def __init__(self, endpoint: str, reason: str = "lost") -> None:
        super().__init__(f"worker {endpoint} {reason}")
        self.endpoint = endpoint
        self.reason = reason


class NoSocketLeft(WorkerLost):
    """No channel could be opened to the worker: the frontend is at its socket or file limit (the
    request never left; a 503)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, "socket_limit")


class _Deadline:
    """Queued for a request whose deadline passed without its final reply."""


_DEADLINE = _Deadline()
_Item = Output | ErrorReply | WorkerLost | _Deadline


class _Inbox:
    """One request's replies; its consumer takes all that arrived at once."""

    __slots__ = ("_loop", "_waiter", "items")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def replace(self, item: _Item) -> None:
        """Drop whatever is queued: ``item`` is reported at once."""
        self.items.clear()
        self.put(item)

    async def take(self) -> list[_Item]:
        while not self.items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self.items)
        self.items.clear()
        return items


class _Channel:
    """One worker endpoint: its DEALER, receive task, watchdog, and the queues of its requests."""

    def __init__(self, endpoint: str, socket: zmq.asyncio.Socket, client: RequestPlaneClient) -> None:
        self.endpoint = endpoint
        self.socket = socket
        # Cancel and Ping must go out from ``finally`` blocks without awaiting: a sync shadow.
        self._shadow: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self.stall_timeout_s = client.stall_timeout_s
        self.idle_close_s = client.idle_close_s
        self.connect_timeout_s = client.connect_timeout_s
        self.queues: dict[str, _Inbox] = {}
        self.closed = False
        self.first_heard = asyncio.Event()  # anything at all from the worker since this channel opened
        self._loop = asyncio.get_running_loop()
        self._opened_at = self._loop.time()
        self._heard_at = self._loop.time()
        self._idle_since = self._loop.time()
        self._pings = itertools.count(1)
        self._readable: asyncio.Future[None] | None = None  # the receive loop, waiting
        self._polling: asyncio.Future[Any] | None = None
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def heard(self) -> bool:
        return self.first_heard.is_set()

    def open(self, request_id: str) -> _Inbox:
        if request_id in self.queues:
            raise ValueError(f"request_id {request_id!r} is already in flight to {self.endpoint}")
        if not self.queues:
            self._heard_at = self._loop.time()  # silence while idle does not count
        inbox = _Inbox(self._loop)
        self.queues[request_id] = inbox
        return inbox

    async def send(self, message: wire.ToWorker) -> None:
        if self.closed:
            raise WorkerLost(self.endpoint, "closed")
        await self.socket.send(wire.encode(message))
        self._kick()

    def send_nowait(self, message: wire.ToWorker) -> None:
        """Best effort: dropped when the socket is closed or its queue is full."""
        if self.closed:
            return
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self._shadow.send(wire.encode(message), zmq.NOBLOCK)
            self._kick()

    def _kick(self) -> None:
        """Wake the receive loop if replies are waiting. ZeroMQ's descriptor is edge-triggered and
        any call on the socket (a send too) may consume the edge of replies that just arrived:
        without this check they would wait unseen until the next edge, which may never come."""
        waiter = self._readable
        if waiter is not None and not waiter.done() and self._waiting():
            waiter.set_result(None)

    def _waiting(self) -> bool:
        events = self._shadow.get(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    def fail_all(self, error: WorkerLost) -> None:
        """Replace whatever is queued with ``error``: the failure is reported at once."""
        for inbox in self.queues.values():
            inbox.replace(error)

    async def receive(self) -> None:
        """Wake when replies are waiting, then take every one of them without awaiting.

        Per reply this is the frontend's hottest loop (a reply per token): no call but the
        receive and the decode; an undecodable reply is named the one way every edge does."""
        recv, decode, queues = self._shadow.recv, wire.from_worker_decoder.decode, self.queues
        while True:
            await self._until_readable()
            self._heard_at = self._loop.time()
            self.first_heard.set()
            while True:
                try:
                    payload = recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    reply = decode(payload)
                except (msgspec.DecodeError, RecursionError):
                    self._reject(payload)
                    continue
                if reply.__class__ is Pong or reply.__class__ is wire.FileData:
                    continue
                inbox = queues.get(reply.request_id)
                if inbox is not None:
                    inbox.put(reply)  # type: ignore[arg-type]

    async def _until_readable(self) -> None:
        """Replies are waiting: the descriptor said so (one poll kept pending across waits: a
        cancelled poll would leave its watcher queued in pyzmq ahead of the next one), or a send
        found them (``_kick``)."""
        if self._waiting():
            return
        if self._polling is None or self._polling.done():
            self._polling = asyncio.ensure_future(self.socket.poll())  # POLLIN
            self._polling.add_done_callback(self._polled)
        self._readable = self._loop.create_future()
        try:
            await self._readable
        finally:
            self._readable = None

    def _polled(self, _: object) -> None:
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _reject(self, payload: bytes) -> None:
        try:
            wire.decode_from_worker(payload)
        except wire.WireDecodeError as exc:
            log.warning("reply_rejected", endpoint=self.endpoint, reason=exc.reason, error=exc.detail[:200])

    def finish(self, request_id: str) -> None:
        """Forget a request; the endpoint's idle time starts with its last request."""
        self.queues.pop(request_id, None)
        if not self.queues:
            self._idle_since = self._loop.time()

    async def watch(self, on_lost: Callable[[str, str], None], on_idle: Callable[[str], None]) -> None:
        """Ping a busy, silent endpoint; declare it lost after ``stall_timeout_s`` of silence, or
        unreachable when it never answered ``connect_timeout_s`` after its first request. Close it
        after ``idle_close_s`` without requests."""
        probe_s = min(self.stall_timeout_s / PROBES_PER_STALL, self.idle_close_s, self.connect_timeout_s / 2)
        while True:
            await asyncio.sleep(probe_s)  # a periodic timer, not a synchronisation
            now = self._loop.time()
            if not self.queues:
                if now - self._idle_since >= self.idle_close_s:
                    on_idle(self.endpoint)
                    return
                continue
            silent_s = now - self._heard_at
            if not self.heard and now - self._opened_at >= min(self.connect_timeout_s, self.stall_timeout_s):
                log.warning(
                    "worker_unreachable", endpoint=self.endpoint, waited_s=round(now - self._opened_at, 3)
                )
                on_lost(self.endpoint, "unreachable")
                return
            if silent_s >= self.stall_timeout_s:
                log.warning("worker_stalled", endpoint=self.endpoint, silent_s=round(silent_s, 3))
                on_lost(self.endpoint, "stalled")
                return
            if silent_s >= probe_s or not self.heard:
                self.send_nowait(Ping(request_id=f"ping-{next(self._pings)}"))

    def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            task.cancel()
        if self._polling is not None:
            self._polling.cancel()
        self.socket.close(linger=0)


def _failure(item: ErrorReply | WorkerLost | _Deadline, endpoint: str) -> WorkerError | WorkerLost:
    if isinstance(item, WorkerLost):
        return item
    if isinstance(item, ErrorReply):
        return WorkerError(item.code, item.message, endpoint=endpoint)
    return WorkerError(504, "no reply by the deadline", endpoint=endpoint)


class RequestPlaneClient:
    """Streams generations from workers over shared per-endpoint DEALER sockets."""

    def __init__(
        self,
        context: zmq.asyncio.Context | None = None,
        *,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        idle_close_s: float = DEFAULT_IDLE_CLOSE_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        refused: Counter | None = None,
    ) -> None:
        if min(stall_timeout_s, idle_close_s, connect_timeout_s) <= 0:
            raise ValueError(
                f"timeouts must be positive, got {stall_timeout_s}, {idle_close_s} and {connect_timeout_s}"
            )
        self._context = context or zmq.asyncio.Context.instance()
        self.stall_timeout_s = stall_timeout_s
        self.idle_close_s = idle_close_s
        self.connect_timeout_s = connect_timeout_s
        self._channels: dict[str, _Channel] = {}
        self._unreachable: dict[str, float] = {}  # endpoint -> until (loop time)
        self._refused = refused  # requests refused for want of a socket
        self._refusal_log = RateLimiter()

    async def generate(
        self, endpoint: str, request: PreprocessedRequest, *, request_id: str, timeout_s: float
    ) -> AsyncGenerator[Output, None]:
        """Yield the worker's Outputs up to the one with ``finish_reason``.

        Raises ``WorkerError`` on an ErrorReply (or 504 if even the deadline reply never comes),
        ``WorkerLost`` if the worker is lost. Stopping early (``aclose``, cancellation) sends Cancel.
        """
        channel = self._channel(endpoint)
        inbox = channel.open(request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.call_at(loop.time() + timeout_s + DEADLINE_GRACE_S, inbox.put, _DEADLINE)
        finished = False
        try:
            deadline_ms = now_ms() + int(timeout_s * 1000)
            await channel.send(Generate(request_id=request_id, request=request, deadline_ms=deadline_ms))
            while not finished:
                outputs: list[Output] = []
                failure: Exception | None = None
                for item in await inbox.take():
                    if not isinstance(item, Output):
                        failure = _failure(item, endpoint)
                        finished = not isinstance(item, _Deadline)  # past the deadline: Cancel it
                        break
                    outputs.append(item)
                    if item.finish_reason is not None:
                        finished = True
                        break
                if outputs:
                    yield merged(outputs)  # tokens that arrived before a failure still count (migration)
                if failure is not None:
                    raise failure
        finally:
            deadline.cancel()
            channel.finish(request_id)
            if not finished:
                channel.send_nowait(Cancel(request_id=request_id))
                log.debug("request_cancel_sent", request_id=request_id, endpoint=endpoint)

    def endpoint_lost(self, endpoint: str) -> None:
        """Fail every in-flight request to ``endpoint`` with ``WorkerLost`` now and close its socket.

        Call it when an instance expires (died), not on a withdraw: a withdrawn worker is draining
        and its in-flight streams still finish.
        """
        self._lose(endpoint, "removed")

    async def answers(self, endpoint: str, timeout_s: float) -> bool:
        """Whether ``endpoint`` answers (a Ping, or anything) within ``timeout_s``: a live worker
        does in milliseconds, a forged or black-holed announce never does. The channel stays open
        for requests and closes when idle, as any."""
        channel = self._channel(endpoint)
        if not channel.heard:
            channel.send_nowait(Ping(request_id="probe"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.first_heard.wait(), timeout_s)
        return channel.heard

    def unreachable_endpoints(self) -> frozenset[str]:
        """Endpoints that never answered a recent request: route elsewhere while there is elsewhere."""
        if not self._unreachable:
            return frozenset()
        now = asyncio.get_running_loop().time()
        for endpoint, until in list(self._unreachable.items()):
            channel = self._channels.get(endpoint)
            if until <= now or (channel is not None and channel.heard):  # it answered after all
                del self._unreachable[endpoint]
        return frozenset(self._unreachable)

    @property
    def endpoints(self) -> list[str]:
        """The endpoints with an open channel (socket and tasks) right now."""
        return sorted(self._channels)

    async def close(self) -> None:
        for endpoint in list(self._channels):
            self._lose(endpoint, "client closed")
        await asyncio.sleep(0)  # let the cancelled channel tasks unwind

    def _lose(self, endpoint: str, reason: str) -> None:
        channel = self._channels.pop(endpoint, None)
        if channel is None:
            return
        if reason == "unreachable":
            self._unreachable[endpoint] = asyncio.get_running_loop().time() + UNREACHABLE_HOLD_S
        log.info("worker_lost", endpoint=endpoint, reason=reason, in_flight=len(channel.queues))
        channel.fail_all(WorkerLost(endpoint, reason))
        channel.close()

    def _close_idle(self, endpoint: str) -> None:
        channel = self._channels.get(endpoint)
        if channel is None or channel.queues:  # never close under a request (none can race: no await)
            return
        del self._channels[endpoint]
        log.debug("request_plane_channel_closed", endpoint=endpoint, reason="idle")
        channel.close()

    def _channel(self, endpoint: str) -> _Channel:
        channel = self._channels.get(endpoint)
        if channel is not None:
            return channel
        try:
            socket = self._context.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            if not is_exhausted(exc):
                raise
            self._no_socket(endpoint, exc)
            raise NoSocketLeft(endpoint) from None
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:  # no ZeroMQ address ("nonsense://x"): nothing will ever answer
            socket.close(linger=0)
            raise self._bad_address(endpoint, exc) from None
        channel = _Channel(endpoint, socket, self)
        channel.tasks = [
            asyncio.create_task(channel.receive(), name=f"request-plane-recv-{endpoint}"),
            asyncio.create_task(
                channel.watch(self._lose, self._close_idle), name=f"request-plane-watch-{endpoint}"
            ),
        ]
        self._channels[endpoint] = channel
        return channel

    def _bad_address(self, endpoint: str, exc: zmq.ZMQError) -> WorkerLost:
        """An endpoint libzmq cannot connect to is unreachable at once (its requests move for free)
        and kept out of routing like one that never answered; its log line at most once a second."""
        now = asyncio.get_running_loop().time()
        self._unreachable[endpoint] = now + UNREACHABLE_HOLD_S
        if self._refusal_log.allow("bad_address", now) is not None:
            log.warning("worker_unreachable", endpoint=endpoint[:200], waited_s=0.0, error=str(exc))
        return WorkerLost(endpoint, "unreachable")

    def _no_socket(self, endpoint: str, exc: zmq.ZMQError) -> None:
        """Count a request refused at the socket limit; its log line at most once a second."""
        if self._refused is not None:
            self._refused.inc()
        suppressed = self._refusal_log.allow("socket_limit", asyncio.get_running_loop().time())
        if suppressed is not None:
            log.warning(
                "request_plane_refused",
                endpoint=endpoint,
                reason="socket_limit",
                error=str(exc),
                channels=len(self._channels),
                suppressed=suppressed,
            )
