"""The frontend's side of the request plane: transport only (which instance, and what to do when
one is lost, is ``migration.py``'s policy).

One DEALER per worker endpoint carries every request to it; the event loop's reader callback on
its descriptor routes replies to per-request queues by ``request_id``. A worker that dies says
nothing, so each endpoint has a watchdog: when a busy endpoint has been silent for a while it is
pinged (a slow worker still answers), and after ``stall_timeout_s`` of silence every request on it
fails with ``WorkerLost``. The discovery watcher makes that immediate by calling ``endpoint_expired`` when an
instance expires, unless the channel still delivers: then its streams stay until it has been silent
for ``expired_grace_s`` (a worker whose heartbeats were late, or lost, is not dead while it streams).
An endpoint that has never answered anything ``connect_timeout_s`` after its
first request is ``unreachable`` (a black-holed or forged announce): its requests fail at once, and
it is kept out of routing (``unreachable_endpoints``) until it answers or ``UNREACHABLE_HOLD_S``
passes.

An endpoint without requests for ``idle_close_s`` is closed by the same watchdog: a worker that
stopped gracefully is withdrawn, never expired, so nothing else would ever close its socket, its
watchdog task and libzmq's reconnect attempts to its dead port. The next request reopens it.

Per message the cost is kept small: the channel wakes once per batch of arrived replies and
drains them without awaiting (no Future per message); a request's consumer
takes everything queued for it at once, and consecutive Outputs are merged into one (token ids
concatenated, the last usage and finish reason), so a busy frontend handles a burst of tokens as
one step. The request's deadline is one timer, not a timeout per message.

A worker's replies are not trusted (docs/operations.md, "Worker replies"): a stream is cut at its
``max_tokens`` (``length``, and the worker told to stop), a request's unread replies are bounded
(``MAX_BUFFERED_TOKENS``: past it the client is too slow and the stream is cancelled), a request
with no token ``first_token_timeout_s`` after it was sent, or a stream without one for
``stream_stall_timeout_s`` after its first, fails over like a lost worker (unless its instance is
busy: ``busy(endpoint)``, a queue its heartbeat reports, keeps the request in its place), error
messages are cut, and a worker that floods the channel with replies nobody asked for, or with
undecodable frames, has its channel dropped (its requests fail over); the replies still in flight
to a stream the frontend cancelled are dropped uncounted for ``LATE_GRACE_S``. Each receive wake
takes at most ``DRAIN_BATCH`` replies or ``DRAIN_BYTES``, so a flood cannot hold the loop.
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

from dynamo_prep.frontend.config import (
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_STREAM_STALL_TIMEOUT_S,
    DEFAULT_WORKER_STALL_TIMEOUT_S,
)
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.limits import is_exhausted
from dynamo_prep.logging import DETAIL_CHARS, RateLimiter
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import now_ms
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Cancel, ErrorReply, Generate, Output, Ping, Pong, merged

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "MAX_BUFFERED_TOKENS",
    "NoSocketLeft",
    "RequestPlaneClient",
    "SlowReader",
    "WorkerError",
    "WorkerLost",
]

log = structlog.get_logger("dynamo_prep.frontend")

DEFAULT_STALL_TIMEOUT_S = DEFAULT_WORKER_STALL_TIMEOUT_S
DEFAULT_IDLE_CLOSE_S = 30.0
# A worker answers a Ping within milliseconds; one that never answered anything this long after
# its first request is not there.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
UNREACHABLE_HOLD_S = 30.0
# Probes per stall timeout: a live worker gets several chances to answer a Ping before it is lost.
PROBES_PER_STALL = 4
# Looks per stream stall timeout: a stream is given up on after that long without a token, at most
# a look's length later.
STALL_CHECKS = 4
# How long past its deadline the client waits for the worker's own "deadline" reply.
DEADLINE_GRACE_S = 1.0
# Tokens of one request received and not yet taken by its consumer (its client does not read):
# past this the worker's stream is cancelled; ~0.6 MB a request.
MAX_BUFFERED_TOKENS = 16_384
# Replies with no stream to go to (unknown or ended request, a file nobody fetched): a burst of
# FLOOD_BURST, then FLOOD_PER_S a second; past that the worker floods and its channel is dropped.
# The late replies of cancelled streams stay far below.
FLOOD_BURST, FLOOD_PER_S = 10_000, 1_000
# Undecodable replies: a worker past this burst (refilled per second) is dropped.
GARBAGE_BURST, GARBAGE_PER_S = 100, 10
# Replies of one stream that carry no token and do not end it; more count as unsolicited.
MAX_EMPTY_OUTPUTS = 64
# Replies (and their bytes) taken per wake of a channel before the other callbacks and tasks run.
DRAIN_BATCH, DRAIN_BYTES = 1024, 1 << 20
# A stream the frontend cancelled may have many replies in flight (ZeroMQ's and TCP's buffers hold
# tens of thousands of frames): for this long they are dropped without counting against the worker.
LATE_GRACE_S = 5.0
# A worker's error message as a client gets it (log lines cut it to DETAIL_CHARS).
MAX_WORKER_MESSAGE_CHARS = 1000


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


class SlowReader(Exception):  # noqa: N818 - the name the frontend codes against
    """The request's client read its stream slower than the worker wrote it: past
    ``MAX_BUFFERED_TOKENS`` unread tokens the generation was cancelled."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(f"more than {MAX_BUFFERED_TOKENS} tokens unread; the generation was cancelled")
        self.endpoint = endpoint


class NoSocketLeft(WorkerLost):
    """No channel could be opened to the worker: the frontend is at its socket or file limit (the
    request never left; a 503)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, "socket_limit")


class _Deadline:
    """Queued for a request whose deadline passed without its final reply."""


class _Progress:
    """One request's progress timers: its first-token deadline and its stall checks (each re-armed
    in place), and the stream's token room at the last check."""

    __slots__ = ("first", "quiet_s", "room", "stall")

    def __init__(self, room: int) -> None:
        self.room = room
        self.quiet_s = 0.0
        self.first: asyncio.TimerHandle | None = None
        self.stall: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        for timer in (self.first, self.stall):
            if timer is not None:
                timer.cancel()


class _Overflow:
    """Queued for a request whose unread tokens passed ``MAX_BUFFERED_TOKENS``."""


_DEADLINE = _Deadline()
_OVERFLOW = _Overflow()
_Item = Output | ErrorReply | WorkerLost | _Deadline | _Overflow
# What ``_Inbox.accept`` made of a reply.
_TAKEN, _UNSOLICITED, _CUT, _OVERFLOWED = range(4)


class _Allowance:
    """A token bucket: ``burst`` at once, refilled at ``per_s`` a second."""

    __slots__ = ("_at", "_burst", "_left", "_per_s")

    def __init__(self, burst: int, per_s: float, now: float) -> None:
        self._burst, self._per_s = burst, per_s
        self._left, self._at = float(burst), now

    def spend(self, count: int, now: float) -> bool:
        """Take ``count``; False once the bucket is overdrawn."""
        self._left = min(self._burst, self._left + (now - self._at) * self._per_s) - count
        self._at = now
        return self._left >= 0


class _Inbox:
    """One request's replies; its consumer takes all that arrived at once.

    Consecutive Outputs are merged as they arrive (one object however many frames came), the
    stream is cut at ``room`` tokens (its ``max_tokens``), and what is queued is bounded."""

    __slots__ = (
        "_loop", "_waiter", "buffered", "cancel_sent", "empties", "ended", "items", "room", "started",
        "worker_done",
    )  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, max_tokens: int) -> None:
        self._loop = loop
        self.items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.room = max_tokens  # tokens the stream may still carry
        self.buffered = 0  # tokens queued and not taken yet
        self.empties = 0  # replies without a token that did not end the stream
        self.started = False  # a token (or the end) came: the worker made progress
        self.ended = False  # the stream's last reply is queued; later ones are unsolicited
        self.worker_done = False  # the worker ended it (its final Output, an ErrorReply)
        self.cancel_sent = False

    def accept(self, reply: Output | ErrorReply) -> int:
        """Queue a worker's reply for this request; what was made of it (``_TAKEN``, ...)."""
        if self.ended:
            return _UNSOLICITED
        if reply.__class__ is ErrorReply:
            self.ended = self.started = self.worker_done = True
            self.put(reply)
            return _TAKEN
        return self._output(reply)  # type: ignore[arg-type]

    def _output(self, output: Output) -> int:
        count = len(output.token_ids)
        verdict = _TAKEN
        if count > self.room:
            output = _cut(output, self.room)
            count, verdict = self.room, _CUT
        elif not count and output.finish_reason is None:
            self.empties += 1
            if self.empties > MAX_EMPTY_OUTPUTS:
                return _UNSOLICITED
        self.room -= count
        self.buffered += count
        ended = output.finish_reason is not None
        self.started = self.started or bool(count) or ended
        self.ended, self.worker_done = ended, ended and verdict == _TAKEN
        if self.buffered > MAX_BUFFERED_TOKENS:
            self.ended = True
            self.replace(_OVERFLOW)
            return _OVERFLOWED
        self._append(output)
        return verdict

    def _append(self, output: Output) -> None:
        """Queue ``output``, merged into the Output before it when that one did not end the stream."""
        last = self.items[-1] if self.items else None
        if isinstance(last, Output) and last.finish_reason is None:
            wire.extend_logprobs(last, output)  # before the ids grow
            last.token_ids += output.token_ids
            last.finish_reason = output.finish_reason
            last.prompt_tokens = output.prompt_tokens or last.prompt_tokens
            last.completion_tokens = output.completion_tokens
            last.cached_tokens = output.cached_tokens or last.cached_tokens
        else:
            self.put(output)

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
        self.buffered = 0
        return items


class _Channel:
    """One worker endpoint: its DEALER, watchdog, and the queues of its requests.

    The DEALER is a plain socket whose descriptor the event loop watches (``_ready``): no task,
    poller or future waits on it (a thousand idle channels were 100,000 objects for the collector
    to walk). ``send`` awaits only when the socket's queue is full.
    """

    def __init__(
        self,
        endpoint: str,
        socket: zmq.Socket[bytes],
        client: RequestPlaneClient,
        on_hostile: Callable[[str, str], None],
    ) -> None:
        self.endpoint = endpoint
        self.socket = socket
        self.stall_timeout_s = client.stall_timeout_s
        self.idle_close_s = client.idle_close_s
        self.connect_timeout_s = client.connect_timeout_s
        self._client = client  # where refusals are counted and logged
        self.queues: dict[str, _Inbox] = {}
        self.closed = False
        self.first_heard = asyncio.Event()  # anything at all from the worker since this channel opened
        self._loop = asyncio.get_running_loop()
        self._opened_at = self._loop.time()
        self._heard_at = self._loop.time()
        self._idle_since = self._loop.time()
        self._pings = itertools.count(1)
        self._late: dict[str, float] = {}  # streams cancelled here -> until when their replies are late
        self._flood = _Allowance(FLOOD_BURST, FLOOD_PER_S, self._opened_at)
        self._junk = _Allowance(GARBAGE_BURST, GARBAGE_PER_S, self._opened_at)
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

    def open(self, request_id: str, max_tokens: int) -> _Inbox:
        if request_id in self.queues:
            raise ValueError(f"request_id {request_id!r} is already in flight to {self.endpoint}")
        if not self.queues:
            self._heard_at = self._loop.time()  # silence while idle does not count
        inbox = _Inbox(self._loop, max_tokens)
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

    def cancel(self, request_id: str, inbox: _Inbox) -> None:
        """Tell the worker to stop a stream the frontend gave up on (once)."""
        if not inbox.cancel_sent:
            inbox.cancel_sent = True
            self._late[request_id] = self._loop.time() + LATE_GRACE_S
            self.send_nowait(Cancel(request_id=request_id))

    def _is_late(self, reply: Output | ErrorReply) -> bool:
        """A reply in flight when its stream was cancelled here (its final one ends the grace)."""
        until = self._late.get(reply.request_id)
        if until is None:
            return False
        expired = until < self._loop.time()
        if expired or isinstance(reply, ErrorReply) or reply.finish_reason is not None:
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
            verdict = _UNSOLICITED if inbox is None else inbox.accept(reply)  # type: ignore[arg-type]
            if verdict == _UNSOLICITED:
                if not (self._late and kind is not wire.FileData and self._is_late(reply)):  # type: ignore[arg-type]
                    unsolicited += 1
                continue
            heard = True
            if kind is ErrorReply:
                self._bound_message(reply)  # type: ignore[arg-type]
            if verdict != _TAKEN and inbox is not None:
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
            self._client.refused_replies("unsolicited", unsolicited)
        if (unsolicited or pongs) and not self._flood.spend(unsolicited + pongs, now):
            return "flooding"
        if garbage and first_error is not None:
            self._client.undecodable(self.endpoint, garbage, first_error)
            if not self._junk.spend(garbage, now):
                return "garbage"
        return None

    def _bound_message(self, reply: ErrorReply) -> None:
        if len(reply.message) > MAX_WORKER_MESSAGE_CHARS:
            reply.message = f"{reply.message[:MAX_WORKER_MESSAGE_CHARS]}... ({len(reply.message)} characters)"
            self._client.refused_replies("message_truncated", 1)

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


def _failure(item: _Item, endpoint: str) -> WorkerError | WorkerLost | SlowReader:
    if isinstance(item, WorkerLost):
        return item
    if isinstance(item, ErrorReply):
        return WorkerError(item.code, item.message, endpoint=endpoint)
    if isinstance(item, _Overflow):
        return SlowReader(endpoint)
    return WorkerError(504, "no reply by the deadline", endpoint=endpoint)


def _cut(output: Output, room: int) -> Output:
    """The last output ``max_tokens`` allows: a worker that streams past it is cut, as an engine
    would have stopped (``length``)."""
    dropped = len(output.token_ids) - room
    return msgspec.structs.replace(
        output,
        token_ids=output.token_ids[:room],
        logprobs=None if output.logprobs is None else output.logprobs[:room],
        finish_reason="length",
        completion_tokens=max(output.completion_tokens - dropped, 0),
    )


class RequestPlaneClient:
    """Streams generations from workers over shared per-endpoint DEALER sockets."""

    def __init__(
        self,
        context: zmq.asyncio.Context | None = None,
        *,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        idle_close_s: float = DEFAULT_IDLE_CLOSE_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
        stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
        refused: Counter | None = None,
        metrics: FrontendMetrics | None = None,
        busy: Callable[[str], bool] | None = None,
    ) -> None:
        """``busy(endpoint)``: whether the worker there is busy rather than stuck (its heartbeat
        reports a queue and recent steps): its requests then keep their place past the first-token
        and stall deadlines (``LoadBoard.busy``)."""
        timeouts = (
            stall_timeout_s,
            idle_close_s,
            connect_timeout_s,
            first_token_timeout_s,
            stream_stall_timeout_s,
        )
        if min(timeouts) <= 0:
            raise ValueError(f"timeouts must be positive, got {', '.join(map(str, timeouts))}")
        shared = context or zmq.asyncio.Context.instance()
        self._sync: zmq.Context[Any] = zmq.Context.shadow(shared.underlying)  # plain sockets
        self.stall_timeout_s = stall_timeout_s
        self.idle_close_s = idle_close_s
        self.connect_timeout_s = connect_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.expired_grace_s = stall_timeout_s / PROBES_PER_STALL
        self._busy = busy or (lambda _endpoint: False)
        self._channels: dict[str, _Channel] = {}
        self._unreachable: dict[str, float] = {}  # endpoint -> until (loop time)
        self._held: dict[str, float] = {}  # given up on (flooding, garbage, no first token) -> until
        self._refused = refused  # requests refused for want of a socket
        self._metrics = metrics
        self._refusal_log = RateLimiter()
        self._hostile_log = RateLimiter()

    async def generate(
        self, endpoint: str, request: PreprocessedRequest, *, request_id: str, timeout_s: float
    ) -> AsyncGenerator[Output, None]:
        """Yield the worker's Outputs up to the one with ``finish_reason``.

        Raises ``WorkerError`` on an ErrorReply (or 504 if even the deadline reply never comes),
        ``WorkerLost`` if the worker is lost. Stopping early (``aclose``, cancellation) sends Cancel.
        """
        channel = self._channel(endpoint)
        inbox = channel.open(request_id, request.stop_conditions.max_tokens)
        loop = asyncio.get_running_loop()
        deadline = loop.call_at(loop.time() + timeout_s + DEADLINE_GRACE_S, inbox.put, _DEADLINE)
        progress = _Progress(inbox.room)
        progress.first = loop.call_later(
            self.first_token_timeout_s, self._no_first_token, channel, request_id, inbox, progress
        )
        progress.stall = loop.call_later(
            self._stall_check_s, self._check_stall, channel, request_id, inbox, progress
        )
        try:
            deadline_ms = now_ms() + int(timeout_s * 1000)
            await channel.send(Generate(request_id=request_id, request=request, deadline_ms=deadline_ms))
            finished = False
            while not finished:
                outputs: list[Output] = []
                failure: Exception | None = None
                for item in await inbox.take():
                    if not isinstance(item, Output):
                        failure = _failure(item, endpoint)
                        break
                    outputs.append(item)
                    finished = item.finish_reason is not None
                    if finished:
                        break
                if outputs:
                    yield merged(outputs)  # tokens that arrived before a failure still count (migration)
                if failure is not None:
                    raise failure
        finally:
            deadline.cancel()
            progress.cancel()
            channel.finish(request_id)
            if not inbox.worker_done and not inbox.cancel_sent:  # the client left, a stop string, ...
                channel.cancel(request_id, inbox)
                log.debug("request_cancel_sent", request_id=request_id, endpoint=endpoint)

    def endpoint_expired(self, endpoint: str) -> None:
        """The instance at ``endpoint`` expired (its heartbeats stopped reaching us). A channel that
        still delivers (it spoke within ``expired_grace_s``) keeps its streams until it falls silent
        for that long, or they end; no new request goes there (it left the catalog). Else every
        request on it fails now, as with ``endpoint_lost``."""
        channel = self._channels.get(endpoint)
        if channel is None:
            return
        silent_s = channel.silent_s()
        if not channel.queues or silent_s >= self.expired_grace_s:
            self._lose(endpoint, "removed")
            return
        channel.expired = True
        channel.send_nowait(Ping(request_id="expired"))
        log.info(
            "worker_expired_delivering",
            endpoint=endpoint,
            in_flight=len(channel.queues),
            silent_s=round(silent_s, 3),
            grace_s=self.expired_grace_s,
        )

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
        """Endpoints to route around while there is elsewhere: they never answered a recent
        request, or were given up on recently (flooding, garbage, no first token in time)."""
        if not self._unreachable and not self._held:
            return frozenset()
        now = asyncio.get_running_loop().time()
        for endpoint, until in list(self._unreachable.items()):
            channel = self._channels.get(endpoint)
            if until <= now or (channel is not None and channel.heard):  # it answered after all
                del self._unreachable[endpoint]
        for endpoint, until in list(self._held.items()):
            if until <= now:
                del self._held[endpoint]
        return frozenset(self._unreachable).union(self._held)

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
            socket: zmq.Socket[bytes] = self._sync.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            if not is_exhausted(exc):
                raise
            self._no_socket(endpoint, exc)
            raise NoSocketLeft(endpoint) from None
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES)  # larger: libzmq drops the connection
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:  # no ZeroMQ address ("nonsense://x"): nothing will ever answer
            socket.close(linger=0)
            raise self._bad_address(endpoint, exc) from None
        channel = _Channel(endpoint, socket, self, self._drop)
        channel.tasks = [
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

    # -- a worker's hostile replies (docs/operations.md, "Worker replies") ---------------------

    def refused_replies(self, reason: str, count: int) -> None:
        if self._metrics is not None:
            self._metrics.worker_replies_refused.labels(reason=reason).inc(count)

    def undecodable(self, endpoint: str, count: int, error: Exception) -> None:
        """Count a batch's undecodable replies; one line per second at most, naming the first."""
        reason = "too_deep" if isinstance(error, RecursionError) else "undecodable"
        reason = "invalid" if isinstance(error, msgspec.ValidationError) else reason
        self.refused_replies(reason, count)
        suppressed = self._hostile_log.allow("reply_rejected", asyncio.get_running_loop().time())
        if suppressed is not None:
            detail = str(error)[:DETAIL_CHARS]
            log.warning(
                "reply_rejected",
                endpoint=endpoint,
                reason=reason,
                error=detail,
                frames=count,
                suppressed=suppressed,
            )

    def stream_stopped(self, channel: _Channel, request_id: str, inbox: _Inbox, verdict: int) -> None:
        """The frontend ended a stream the worker still writes: cut at ``max_tokens``, or its
        client reads too slowly (``MAX_BUFFERED_TOKENS`` unread). The worker is told to stop."""
        channel.cancel(request_id, inbox)
        if verdict == _CUT:
            self.refused_replies("past_max_tokens", 1)
            return
        if self._metrics is not None:
            self._metrics.slow_readers.inc()
        self._warn("request_buffer_full", request_id=request_id, endpoint=channel.endpoint)

    def _no_first_token(self, channel: _Channel, request_id: str, inbox: _Inbox, progress: _Progress) -> None:
        """No token ``first_token_timeout_s`` after the request was sent: it fails over like a
        lost worker, the worker is told to stop and is routed around for a while; unless the
        worker is busy (its queue keeps the request's place: the deadline starts again)."""
        if inbox.started or inbox.ended or channel.closed:
            return
        if self._busy(channel.endpoint):
            progress.first = asyncio.get_running_loop().call_later(
                self.first_token_timeout_s, self._no_first_token, channel, request_id, inbox, progress
            )
            log.debug(
                "worker_busy_kept", request_id=request_id, endpoint=channel.endpoint, phase="first_token"
            )
            return
        self._give_up(channel, request_id, inbox, "no_first_token", waited_s=self.first_token_timeout_s)

    @property
    def _stall_check_s(self) -> float:
        return self.stream_stall_timeout_s / STALL_CHECKS

    def _check_stall(self, channel: _Channel, request_id: str, inbox: _Inbox, progress: _Progress) -> None:
        """Every ``stream_stall_timeout_s / STALL_CHECKS``: a stream that got no token over the
        last ``stream_stall_timeout_s`` moves on like one without a first token (its worker is
        routed around), unless the worker is busy. A token costs nothing here: the timer compares
        the stream's token count with the last check's."""
        if inbox.ended or channel.closed:
            return
        if inbox.room != progress.room or not inbox.started:  # the first-token deadline rules until then
            progress.room, progress.quiet_s = inbox.room, 0.0
        else:
            progress.quiet_s += self._stall_check_s
        if progress.quiet_s >= self.stream_stall_timeout_s * (1 - 1e-9):
            if not self._busy(channel.endpoint):
                self._give_up(channel, request_id, inbox, "stalled_stream", waited_s=progress.quiet_s)
                return
            progress.quiet_s = 0.0
            log.debug("worker_busy_kept", request_id=request_id, endpoint=channel.endpoint, phase="stream")
        progress.stall = asyncio.get_running_loop().call_later(
            self._stall_check_s, self._check_stall, channel, request_id, inbox, progress
        )

    def _give_up(
        self, channel: _Channel, request_id: str, inbox: _Inbox, reason: str, *, waited_s: float
    ) -> None:
        """The stream fails over (``WorkerLost(reason)``), its worker told to stop and routed around."""
        inbox.ended = True
        inbox.replace(WorkerLost(channel.endpoint, reason))
        channel.cancel(request_id, inbox)
        self._hold(channel.endpoint)
        event = "worker_no_first_token" if reason == "no_first_token" else "worker_stream_stalled"
        self._fault(reason, event, request_id=request_id, endpoint=channel.endpoint, waited_s=waited_s)

    def _drop(self, endpoint: str, reason: str) -> None:
        """A flooding worker (replies nobody asked for, or garbage): its channel is closed and its
        requests fail over, as for a dead worker; it is routed around for a while."""
        channel = self._channels.get(endpoint)
        in_flight = len(channel.queues) if channel is not None else 0
        self._hold(endpoint)
        self._fault(reason, "worker_dropped", endpoint=endpoint, in_flight=in_flight)
        self._lose(endpoint, reason)

    def _hold(self, endpoint: str) -> None:
        self._held[endpoint] = asyncio.get_running_loop().time() + UNREACHABLE_HOLD_S

    def _fault(self, reason: str, event: str, **fields: object) -> None:
        if self._metrics is not None:
            self._metrics.worker_faults.labels(reason=reason).inc()
        self._warn(event, key=f"{event}:{reason}", reason=reason, **fields)

    def _warn(self, event: str, *, key: str = "", **fields: object) -> None:
        """A warning about a worker's replies, at most once a second per ``key`` (the event's name)."""
        suppressed = self._hostile_log.allow(key or event, asyncio.get_running_loop().time())
        if suppressed is not None:
            log.warning(event, suppressed=suppressed, **fields)
