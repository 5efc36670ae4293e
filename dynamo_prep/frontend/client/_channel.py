"""One worker endpoint's channel: its DEALER, its requests' inboxes, its watchdog and its judgement
of what the worker sends (docs/request-plane.md, "Client behaviour")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec
import structlog
import zmq

from dynamo_prep.frontend.client._allowance import Allowance, Refusals
from dynamo_prep.frontend.client._errors import WorkerLost
from dynamo_prep.frontend.client._inbox import TAKEN, UNSOLICITED, Inbox, Reply
from dynamo_prep.frontend.client._limits import (
    DRAIN_BATCH,
    DRAIN_BYTES,
    FLOOD_BURST,
    FLOOD_PER_S,
    GARBAGE_BURST,
    GARBAGE_PER_S,
    LATE_GRACE_S,
    MAX_WORKER_MESSAGE_CHARS,
    PROBES_PER_STALL,
)
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.wire import Cancel, ErrorReply, Output, Ping, Pong

log = structlog.get_logger("dynamo_prep.frontend")

_I = TypeVar("_I", bound=Inbox)


class Owner(Protocol):
    """What a channel needs of its client: the timeouts, the account of refused replies, and what
    to do with a stream it stopped."""

    stall_timeout_s: float
    idle_close_s: float
    connect_timeout_s: float
    expired_grace_s: float
    refusals: Refusals

    def stream_stopped(self, channel: Channel, request_id: str, inbox: Inbox, verdict: int) -> None: ...


class Channel:
    """One worker endpoint: its DEALER, watchdog, and the queues of its requests.

    The DEALER is a plain socket whose descriptor the event loop watches (``_ready``): no task,
    poller or future waits on it (a thousand idle channels were 100,000 objects for the collector
    to walk). ``send`` awaits only when the socket's queue is full.
    """

    def __init__(
        self,
        endpoint: str,
        socket: zmq.Socket[bytes],
        client: Owner,
        on_hostile: Callable[[str, str], None],
    ) -> None:
        self.endpoint = endpoint
        self.socket = socket
        self.stall_timeout_s = client.stall_timeout_s
        self.idle_close_s = client.idle_close_s
        self.connect_timeout_s = client.connect_timeout_s
        self._client = client  # where refusals are counted and logged
        self.queues: dict[str, Inbox] = {}
        self.closed = False
        self.first_heard = asyncio.Event()  # anything at all from the worker since this channel opened
        self._loop = asyncio.get_running_loop()
        self._opened_at = self._loop.time()
        self._heard_at = self._loop.time()
        self._idle_since = self._loop.time()
        self._pings = itertools.count(1)
        self._late: dict[str, float] = {}  # streams cancelled here -> until when their replies are late
        self._flood = Allowance(FLOOD_BURST, FLOOD_PER_S, self._opened_at)
        self._junk = Allowance(GARBAGE_BURST, GARBAGE_PER_S, self._opened_at)
        self._on_hostile = on_hostile  # (endpoint, reason): drop a flooding worker
        self._scheduled = False  # a pass over the socket is queued
        self._writable: asyncio.Future[None] | None = None  # a send waiting for room
        self.expired = False  # its instance expired: its streams stay only while it speaks
        self.tasks: list[asyncio.Task[None]] = []
        self._loop.add_reader(socket.fileno(), self._ready)

    @property
    def heard(self) -> bool:
        return self.first_heard.is_set()

    def silent_s(self) -> float:
        """How long the worker has said nothing (since the channel got busy, at most)."""
        return self._loop.time() - self._heard_at

    def open(self, request_id: str, inbox: _I) -> _I:
        if request_id in self.queues:
            raise ValueError(f"request_id {request_id!r} is already in flight to {self.endpoint}")
        if not self.queues:
            self._heard_at = self._loop.time()  # silence while idle does not count
        self.queues[request_id] = inbox
        return inbox

    async def send(self, message: wire.ToWorker) -> None:
        data = wire.encode(message)
        while True:
            if self.closed:
                raise WorkerLost(self.endpoint, "closed")
            try:
                self.socket.send(data, zmq.NOBLOCK)
                break
            except zmq.Again:  # its queue is full: wait for room (``_pass`` sees it)
                self._writable = self._loop.create_future()
                try:
                    await self._writable
                finally:
                    self._writable = None
        self._kick()

    def send_nowait(self, message: wire.ToWorker) -> None:
        """Best effort: dropped when the socket is closed or its queue is full."""
        if self.closed:
            return
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.socket.send(wire.encode(message), zmq.NOBLOCK)
            self._kick()

    def _kick(self) -> None:
        """Queue a pass if replies are waiting. ZeroMQ's descriptor is edge-triggered and any call
        on the socket (a send too) may consume the edge of replies that just arrived: without this
        check they would wait unseen until the next edge, which may never come."""
        if self._waiting():
            self._again()

    def _events(self) -> int:
        events = self.socket.get(zmq.EVENTS)
        return events if isinstance(events, int) else 0

    def _waiting(self) -> bool:
        return bool(self._events() & zmq.POLLIN)

    def fail_all(self, error: WorkerLost) -> None:
        """Replace whatever is queued with ``error``: the failure is reported at once."""
        for inbox in self.queues.values():
            inbox.replace(error)

    def cancel(self, request_id: str, inbox: Inbox) -> None:
        """Tell the worker to stop a stream the frontend gave up on (once)."""
        if not inbox.cancel_sent:
            inbox.cancel_sent = True
            self._late[request_id] = self._loop.time() + LATE_GRACE_S
            self.send_nowait(Cancel(request_id=request_id))

    def _is_late(self, reply: Reply) -> bool:
        """A reply in flight when its request was cancelled here (its final one ends the grace)."""
        until = self._late.get(reply.request_id)
        if until is None:
            return False
        expired = until < self._loop.time()
        if expired or not isinstance(reply, Output) or reply.finish_reason is not None:
            del self._late[reply.request_id]
        return not expired

    def _ready(self) -> None:
        """The loop saw the socket's descriptor readable."""
        if not self._scheduled:
            self._pass()

    def _again(self) -> None:
        """Queue another pass after what else is ready (more may be waiting: the others run first)."""
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self._loop.call_soon(self._queued)

    def _queued(self) -> None:
        self._scheduled = False
        self._pass()

    def _pass(self) -> None:
        """Wake a send waiting for room, take up to ``DRAIN_BATCH`` replies without awaiting, and
        judge the worker by what it sent: a flooding one is dropped (``on_hostile``)."""
        if self.closed:
            return
        writable = self._writable
        if writable is not None and not writable.done() and self._events() & zmq.POLLOUT:
            writable.set_result(None)
        unsolicited, pongs, garbage, first_error, full = self._drain()
        reason = self._judge(unsolicited, pongs, garbage, first_error)
        if reason is not None:
            self._on_hostile(self.endpoint, reason)
        elif full or self._waiting():
            self._again()

    def _drain(self) -> tuple[int, int, int, Exception | None, bool]:
        """Take waiting replies, at most ``DRAIN_BATCH`` or ``DRAIN_BYTES``: (unsolicited, pongs,
        undecodable, the first decode error, whether the batch was full).

        Per reply this is the frontend's hottest loop (a reply per token): the receive, the
        decode, a dict lookup and the inbox's check; an undecodable reply costs a count."""
        recv, decode, queues = self.socket.recv, wire.from_worker_decoder.decode, self.queues
        unsolicited = pongs = garbage = size = 0
        first_error: Exception | None = None
        heard = full = False
        for _ in range(DRAIN_BATCH):
            if size >= DRAIN_BYTES:
                break
            try:
                payload = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            size += len(payload)
            try:
                reply = decode(payload)
            except (msgspec.DecodeError, RecursionError) as exc:
                garbage += 1
                first_error = first_error or exc
                continue
            kind = reply.__class__
            if kind is Pong:
                heard, pongs = True, pongs + 1
                continue
            inbox = queues.get(reply.request_id) if kind is not wire.FileData else None
            verdict = UNSOLICITED if inbox is None else inbox.accept(reply)  # type: ignore[arg-type]
            if verdict == UNSOLICITED:
                if not (self._late and kind is not wire.FileData and self._is_late(reply)):  # type: ignore[arg-type]
                    unsolicited += 1
                continue
            heard = True
            if kind is ErrorReply:
                self._bound_message(reply)  # type: ignore[arg-type]
            if verdict != TAKEN and inbox is not None:
                self._client.stream_stopped(self, reply.request_id, inbox, verdict)
        else:
            full = True
        full = full or size >= DRAIN_BYTES
        if heard:
            self._heard_at = self._loop.time()
            self.first_heard.set()
        return unsolicited, pongs, garbage, first_error, full

    def _judge(self, unsolicited: int, pongs: int, garbage: int, first_error: Exception | None) -> str | None:
        """Count a batch's refused replies; the reason to drop the worker once it floods (pongs
        spend the same allowance: the watchdog asks for about one a second)."""
        now = self._loop.time()
        if unsolicited:
            self._client.refusals.replies("unsolicited", unsolicited)
        if (unsolicited or pongs) and not self._flood.spend(unsolicited + pongs, now):
            return "flooding"
        if garbage and first_error is not None:
            self._client.refusals.undecodable(self.endpoint, garbage, first_error)
            if not self._junk.spend(garbage, now):
                return "garbage"
        return None

    def _bound_message(self, reply: ErrorReply) -> None:
        if len(reply.message) > MAX_WORKER_MESSAGE_CHARS:
            reply.message = f"{reply.message[:MAX_WORKER_MESSAGE_CHARS]}... ({len(reply.message)} characters)"
            self._client.refusals.replies("message_truncated", 1)

    def finish(self, request_id: str) -> None:
        """Forget a request; the endpoint's idle time starts with its last request."""
        self.queues.pop(request_id, None)
        if not self.queues:
            self._idle_since = self._loop.time()
            self.expired = False  # the expired instance's streams are over; a re-announce starts afresh

    async def watch(self, on_lost: Callable[[str, str], None], on_idle: Callable[[str], None]) -> None:
        """Ping a busy, silent endpoint; declare it lost after ``stall_timeout_s`` of silence, or
        unreachable when it never answered ``connect_timeout_s`` after its first request. Close it
        after ``idle_close_s`` without requests."""
        probe_s = min(self.stall_timeout_s / PROBES_PER_STALL, self.idle_close_s, self.connect_timeout_s / 2)
        while True:
            await asyncio.sleep(probe_s)  # a periodic timer, not a synchronisation
            now = self._loop.time()
            if self._late:
                self._late = {request_id: until for request_id, until in self._late.items() if until >= now}
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
            limit = self._client.expired_grace_s if self.expired else self.stall_timeout_s
            if silent_s >= limit:
                log.warning(
                    "worker_stalled",
                    endpoint=self.endpoint,
                    silent_s=round(silent_s, 3),
                    expired=self.expired,
                )
                on_lost(self.endpoint, "removed" if self.expired else "stalled")
                return
            if silent_s >= probe_s or not self.heard:
                self.send_nowait(Ping(request_id=f"ping-{next(self._pings)}"))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # the send sees ``closed``
        self._loop.remove_reader(self.socket.fileno())
        self.socket.close(linger=0)
