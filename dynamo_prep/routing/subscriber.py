"""Frontend side of the KV-event plane: follow the publisher of every live instance into one sink.

Per instance: a SUB connected to ``kv_events.endpoint`` (subscribed to its topic) and, while a
replay is outstanding, a DEALER to its ``replay_endpoint`` (opened for the replay, closed after it).
Each instance is served by its own reader callbacks on the event loop, so a slow or hostile
publisher can only delay or reset its own blocks. Rules (``follower.py`` has the details,
docs/kv-events.md the reasons):

* An instance is followed only at addresses no other followed instance claims and on its own host
  (``endpoints.py``), and only while it has a socket to spare (KV following takes at most
  ``KV_SOCKET_SHARE`` of the context's MAX_SOCKETS): otherwise it is refused (logged, counted) and
  tried again ``RETRY_S`` later, never a failure of the caller.
* On ``add``, catch up first: subscribe, replay everything from seq 0, apply the replayed batches
  in order, then the live ones buffered meanwhile with a higher seq. Without a replay endpoint,
  start from the first live batch.
* Apply in seq order; a duplicate is dropped; a gap triggers a replay from ``last + 1`` (live is
  buffered meanwhile); if the replay cannot fill it (no endpoint, no answer within the deadline,
  the publisher no longer buffers ``last + 1``), ``sink.reset`` and resync from what there is.
  A publisher restart (the live seq goes back) resets the instance and starts over.
* ``remove`` (the instance expired or withdrew) closes its sockets and calls ``sink.reset``.
* Garbage never crashes, blocks, or touches another instance: frames above ``MAX_FRAME_BYTES``
  are refused by libzmq, everything else is decoded once, counted by reason and logged at most
  once per (instance, reason) per second. libzmq drops such a peer for good (a protocol error is
  never retried), so the SUB reconnects itself after any disconnect, backing off from
  ``RECONNECT_DELAY_S`` to ``RECONNECT_MAX_S`` while the connections keep dropping; what was lost
  meanwhile is a gap like any other.
* Transport cost: the sockets are plain (synchronous) ones whose descriptors the event loop
  watches: no task, poller or future per instance (121 objects for the garbage collector to walk
  per followed instance before, about 50 now). A pass drains up to ``max_drain`` messages per
  socket; libzmq's descriptor signals edges, so a pass that leaves messages queues another
  (``call_soon``: other callbacks run first). A drain stops once the follower has work waiting (a
  long batch, applied a slice per pass, ``follower.py``); the rest stays in the socket until that
  work is done.

Every method runs on the frontend's event loop; ``run()`` serves until ``close()`` or cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.limits import is_exhausted
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.discovery import Instance, KvEventsEndpoint
from dynamo_prep.protocol.kv_events import MAX_BATCH_BYTES, replay_request
from dynamo_prep.routing.endpoints import KvEndpointRules
from dynamo_prep.routing.eventlog import KvLog
from dynamo_prep.routing.follower import (
    APPLY_SLICE_BLOCKS,
    REPLAY_TIMEOUT_S,
    InstanceFollower,
    KvEventSink,
    PendingBudget,
)
from dynamo_prep.routing.metrics import KvMetrics

__all__ = ["MAX_DRAIN_PER_WAKE", "MAX_FRAME_BYTES", "KvEventSink", "KvEventSubscriber"]

MAX_DRAIN_PER_WAKE = 256
# libzmq refuses (and disconnects) above this; well above MAX_BATCH_BYTES so that oversize payloads
# still arrive and are counted as too_large.
MAX_FRAME_BYTES = 2 * MAX_BATCH_BYTES
LIVE_RCVHWM = 100_000  # vLLM's send HWM: a burst the loop has not drained yet is not dropped
REPLAY_RCVHWM = 100_000  # above the publisher's buffer (10,000): a whole replay fits in the pipe
# Our reconnect after a dropped connection: the first after this, each next one twice as late while
# connections keep dropping, up to RECONNECT_MAX_S (a connection that lived that long starts over).
RECONNECT_DELAY_S = 0.2
RECONNECT_MAX_S = 30.0
# libzmq's own retries of a refused connection back off the same way (its interval doubles).
RECONNECT_IVL_MAX_MS = int(RECONNECT_MAX_S * 1000)
# A replay DEALER lives one replay deadline: its reconnects are spaced this far apart.
REPLAY_RECONNECT_IVL_MS = 1000
# Instances refused for want of a socket, or for an endpoint another one claims, are retried this often.
RETRY_S = 1.0
# Sockets a followed instance holds between replays: its SUB, the SUB's monitor and the PAIR reading it.
SOCKETS_PER_INSTANCE = 3
# KV following takes at most this share of the context's MAX_SOCKETS: the rest stays for the request
# plane (a DEALER per worker), discovery and file transfers, whatever the number of KV publishers.
KV_SOCKET_SHARE = 0.75
ERROR_BACKOFF_S = 1.0
# A timed pass runs this late: never a hair before the deadline it is for.
TIMER_SLACK_S = 0.001
_monitor_ids = itertools.count()
log = structlog.get_logger("dynamo_prep.routing")


class _DealerChannel:
    """The ``ReplayChannel`` of one instance: a DEALER while a replay is outstanding (and a new one
    for each replay), closed by its owner after the replay. ``watch``/``unwatch`` put its socket on
    the event loop and take it off (before the socket is closed)."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        on_exhausted: Callable[[str], None],
        watch: Callable[[zmq.Socket[Any]], None],
        unwatch: Callable[[zmq.Socket[Any]], None],
    ) -> None:
        self.address = address
        self.socket: zmq.Socket[Any] | None = None
        self._context = context
        self._on_exhausted = on_exhausted
        self._watch = watch
        self._unwatch = unwatch

    def open(self) -> None:
        """Create and connect the DEALER (raises ``zmq.ZMQError`` on a bad address or no socket left)."""
        if self.socket is not None:
            return
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        socket.setsockopt(zmq.RECONNECT_IVL, REPLAY_RECONNECT_IVL_MS)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        try:
            socket.connect(self.address)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self.socket = socket
        self._watch(socket)

    def request(self, start_seq: int) -> None:
        try:
            self.open()
            assert self.socket is not None
            self.socket.send_multipart(replay_request(start_seq), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # no answer will come: the follower's deadline resets the instance
            if is_exhausted(exc):
                self._on_exhausted(str(exc))

    def cancel(self) -> None:
        self.close()

    def close(self) -> None:
        socket, self.socket = self.socket, None
        if socket is not None:
            self._unwatch(socket)
            socket.close(linger=0)


@dataclass(slots=True, eq=False)
class _Followed:
    """One followed instance: its sockets and its ordering state.

    ``monitor`` is a PAIR receiving the SUB's disconnect events (libzmq's socket monitor). The
    sockets are plain (synchronous) ones whose descriptors the event loop watches; ``scheduled``:
    a pass over them is queued; ``timer``: the pass queued for the replay deadline or the reconnect.
    """

    kv: KvEventsEndpoint
    follower: InstanceFollower
    socket: zmq.Socket[Any]
    monitor: zmq.Socket[Any]
    channel: _DealerChannel | None
    log: KvLog
    scheduled: bool = False
    timer: asyncio.TimerHandle | None = None
    reconnect_at: float | None = None
    connected_at: float = field(default_factory=time.monotonic)
    drops: int = 0  # connections dropped in a row, each lasting less than RECONNECT_MAX_S
    closed: bool = False

    def monitor_disconnects(self) -> None:
        """On a disconnect of the SUB (events drained from the monitor): stop libzmq's own retries
        (every 100 ms, forever) and reconnect later, twice as late as last time if the connection
        that dropped was short-lived."""
        disconnected = False
        while True:
            try:
                self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            disconnected = True
        if not disconnected or self.reconnect_at is not None:
            return
        with contextlib.suppress(zmq.ZMQError):  # libzmq may have forgotten the endpoint already
            self.socket.disconnect(self.kv.endpoint)
        now = time.monotonic()
        self.drops = 0 if now - self.connected_at >= RECONNECT_MAX_S else self.drops + 1
        self.reconnect_at = now + reconnect_delay(self.drops)

    def reconnect(self) -> None:
        self.reconnect_at = None
        with contextlib.suppress(zmq.ZMQError):  # libzmq may have forgotten the endpoint already
            self.socket.disconnect(self.kv.endpoint)
        self.socket.connect(self.kv.endpoint)
        self.connected_at = time.monotonic()
        self.log.reconnected(self.kv.endpoint)


def reconnect_delay(drops: int) -> float:
    """How long after the ``drops``-th short-lived connection in a row the SUB reconnects."""
    return min(RECONNECT_MAX_S, RECONNECT_DELAY_S * (1 << min(max(drops - 1, 0), 16)))


class KvEventSubscriber:
    """Follows the KV publishers of the instances it is given and feeds ``sink`` in seq order."""

    def __init__(
        self,
        sink: KvEventSink,
        *,
        metrics: KvMetrics | None = None,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        max_drain: int = MAX_DRAIN_PER_WAKE,
        rules: KvEndpointRules | None = None,
    ) -> None:
        self.sink = sink
        self.metrics = metrics if metrics is not None else KvMetrics()
        self.rules = rules if rules is not None else KvEndpointRules()
        shared = context or zmq.asyncio.Context.instance()
        self._context: zmq.Context[Any] = zmq.Context.shadow(shared.underlying)  # plain sockets
        self.max_instances = int(self._context.get(zmq.MAX_SOCKETS) * KV_SOCKET_SHARE) // SOCKETS_PER_INSTANCE
        self._clock = clock
        self._timeout_s = replay_timeout_s
        self._max_drain = max_drain
        self._followed: dict[str, _Followed] = {}
        self._waiting: dict[str, Instance] = {}  # refused for now (socket limit, endpoint in use)
        self._budget = PendingBudget()  # the bytes every follower holds, together
        self._limiter = RateLimiter()
        self._loop: asyncio.AbstractEventLoop | None = None  # while ``run()`` serves
        self._stop = asyncio.Event()

    @property
    def instance_ids(self) -> frozenset[str]:
        return frozenset(self._followed)

    @property
    def waiting_ids(self) -> frozenset[str]:
        """Instances refused for now, tried again every ``RETRY_S``."""
        return frozenset(self._waiting)

    def follower(self, instance_id: str) -> InstanceFollower | None:
        """The ordering state of one instance (diagnostics, tests)."""
        followed = self._followed.get(instance_id)
        return followed.follower if followed is not None else None

    # -- membership ----------------------------------------------------------------------------

    def add(self, instance: Instance) -> bool:
        """Follow ``instance``'s KV events (True), or not: it advertises none, its addresses cannot
        be reached or are refused (another instance's, another host's), or no socket is left.

        Adding an instance already followed at the same addresses changes nothing; at other
        addresses it is followed anew (its old blocks are reset).
        """
        current = self._followed.get(instance.instance_id)
        if current is not None:
            if current.kv == instance.kv_events:
                return True
            self.remove(instance.instance_id, reason="kv_events_changed")
        self._waiting.pop(instance.instance_id, None)
        return self._follow(instance, retry=False) is None

    def _follow(self, instance: Instance, *, retry: bool) -> str | None:
        """``add`` past its checks: None when followed, else why not. A refusal is logged and
        counted once, not on each retry."""
        kv = instance.kv_events
        if kv is None:
            return "no_kv_events"
        refusal = self.rules.refusal(instance)
        if refusal is not None:
            reason, detail = refusal
            if reason == "endpoint_in_use":  # followed once the claiming instance is gone
                self._waiting[instance.instance_id] = instance
            if not retry:
                self._refused(instance.instance_id, reason, detail)
            return reason
        if len(self._followed) >= self.max_instances:
            return self._no_socket(instance, f"{self.max_instances} instances followed already", retry=retry)
        try:
            followed = self._open(instance.instance_id, kv)
        except zmq.ZMQError as exc:
            return self._no_socket(instance, str(exc), retry=retry)
        if followed is None:
            return "unreachable"
        self.rules.claim(instance)
        self._followed[instance.instance_id] = followed
        self.metrics.instances.set(len(self._followed))
        followed.log.subscribed(kv)
        followed.follower.start()
        if self._loop is not None:
            self._start(followed)
        return None

    def remove(self, instance_id: str, *, reason: str = "removed") -> None:
        """Stop following an instance (expired, withdrawn): close its sockets, reset its blocks."""
        self._waiting.pop(instance_id, None)
        followed = self._followed.pop(instance_id, None)
        if followed is None:
            return
        self.rules.release(instance_id)
        followed.follower.close()
        self._close(followed)
        self.metrics.instances.set(len(self._followed))
        self.metrics.resets.labels(reason=reason).inc()
        followed.log.unsubscribed(reason)
        with contextlib.suppress(Exception):  # a failing sink is the index's bug; the instance is gone
            self.sink.reset(instance_id)

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve every followed instance until ``close()`` or cancellation, then close them all."""
        self._loop = asyncio.get_running_loop()
        for followed in self._followed.values():
            self._start(followed)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RETRY_S)
                self._retry_waiting()
        finally:
            for followed in self._followed.values():
                self._close(followed)
            self._loop = None
            self._followed.clear()
            self._waiting.clear()
            self.metrics.instances.set(0)

    def close(self) -> None:
        """Stop ``run()`` (the index is not reset: the frontend is going away with it)."""
        self._stop.set()

    def _no_socket(self, instance: Instance, detail: str, *, retry: bool) -> str:
        """No socket left for ``instance``: it waits for a later retry."""
        self._waiting[instance.instance_id] = instance
        if not retry:
            self._refused(instance.instance_id, "socket_limit", detail)
        return "socket_limit"

    def _retry_waiting(self) -> None:
        """Try the refused instances again, in turn; a pass ends at the first with no socket left."""
        for instance_id, instance in list(self._waiting.items()):
            if self._waiting.pop(instance_id, None) is None:
                continue  # removed meanwhile
            if self._follow(instance, retry=True) == "socket_limit":  # the rest would wait too
                return

    def _refused(self, instance_id: str, reason: str, detail: str) -> None:
        """Count a refusal; its log line at most once per reason per second."""
        self.metrics.refused.labels(reason=reason).inc()
        suppressed = self._limiter.allow(reason, time.monotonic())
        if suppressed is not None:
            log.warning(
                "kv_events_refused",
                instance_id=instance_id,
                reason=reason,
                detail=detail[:200],
                suppressed=suppressed,
                waiting=len(self._waiting),
            )

    # -- per instance --------------------------------------------------------------------------

    def _open(self, instance_id: str, kv: KvEventsEndpoint) -> _Followed | None:
        """The sockets of one instance (None: an address libzmq refuses); raises ``zmq.ZMQError``
        when the process has no socket left (every socket made is closed first)."""
        log = KvLog(instance_id)
        topic = kv.topic.encode()
        socket, monitor = self._sub(topic)
        try:
            socket.connect(kv.endpoint)
        except zmq.ZMQError as exc:
            _close_sub(socket, monitor)
            log.connect_failed(kv.endpoint, str(exc), replay=False)
            return None
        channel = None
        if kv.replay_endpoint is not None:
            channel = _DealerChannel(
                self._context,
                kv.replay_endpoint,
                self._replay_exhausted(instance_id),
                watch=lambda replay: self._watch_replay(instance_id, replay),
                unwatch=self._unwatch,
            )
            try:
                channel.open()  # for the catch-up replay at once
            except zmq.ZMQError as exc:  # follow live only: a gap then resets instead of replaying
                if is_exhausted(exc):
                    _close_sub(socket, monitor)
                    raise
                log.connect_failed(kv.replay_endpoint, str(exc), replay=True)
                channel = None
        follower = InstanceFollower(
            instance_id,
            self.sink,
            topic=topic,
            replay=channel,
            metrics=self.metrics,
            clock=self._clock,
            timeout_s=self._timeout_s,
            log=log,
            budget=self._budget,
            slice_blocks=APPLY_SLICE_BLOCKS,
        )
        return _Followed(kv, follower, socket, monitor, channel, log)

    def _sub(self, topic: bytes) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        """A SUB subscribed to ``topic`` and the PAIR its disconnects are reported to."""
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, LIVE_RCVHWM)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            socket.setsockopt(zmq.SUBSCRIBE, topic)
            address = f"inproc://kv-events-monitor-{next(_monitor_ids)}"
            socket.monitor(address, zmq.EVENT_DISCONNECTED)
            monitor = self._context.socket(zmq.PAIR)
        except zmq.ZMQError:
            with contextlib.suppress(zmq.ZMQError):
                socket.monitor(None, 0)
            socket.close(linger=0)
            raise
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        return socket, monitor

    def _replay_exhausted(self, instance_id: str) -> Callable[[str], None]:
        def refused(error: str) -> None:
            self._refused(instance_id, "replay_socket_limit", error)

        return refused

    # -- on the event loop: no task per instance, its descriptors watched ------------------------

    def _start(self, followed: _Followed) -> None:
        """Watch the instance's sockets and make a first pass (messages may be waiting already)."""
        for socket in _sockets(followed):
            self._watch(socket, followed)
        self._again(followed)

    def _watch(self, socket: zmq.Socket[Any], followed: _Followed) -> None:
        assert self._loop is not None
        self._loop.add_reader(socket.fileno(), self._ready, followed)

    def _watch_replay(self, instance_id: str, socket: zmq.Socket[Any]) -> None:
        """A replay DEALER was opened: watched at once while serving (else by ``_start``)."""
        followed = self._followed.get(instance_id)
        if followed is not None and self._loop is not None:
            self._watch(socket, followed)

    def _unwatch(self, socket: zmq.Socket[Any]) -> None:
        """Before a socket is closed: the loop forgets its descriptor."""
        if self._loop is not None and not socket.closed:
            self._loop.remove_reader(socket.fileno())

    def _close(self, followed: _Followed) -> None:
        if followed.closed:
            return
        followed.closed = True
        if followed.timer is not None:
            followed.timer.cancel()
        if followed.channel is not None:
            followed.channel.close()
        for socket in (followed.monitor, followed.socket):
            self._unwatch(socket)
        _close_sub(followed.socket, followed.monitor)

    def _ready(self, followed: _Followed) -> None:
        """The loop saw one of the instance's descriptors readable (libzmq signals edges: a pass
        reads until a socket is empty, or queues another pass)."""
        if not followed.scheduled:
            self._pump(followed)

    def _again(self, followed: _Followed) -> None:
        """Queue another pass after what else is ready (a flooded instance lets the others run)."""
        if not followed.scheduled and self._loop is not None:
            followed.scheduled = True
            self._loop.call_soon(self._queued, followed)

    def _queued(self, followed: _Followed) -> None:
        followed.scheduled = False
        self._pump(followed)

    def _timed(self, followed: _Followed) -> None:
        followed.timer = None
        if not followed.scheduled:
            self._pump(followed)

    def _pump(self, followed: _Followed) -> None:
        if followed.closed:
            return
        try:
            self._pass(followed)
        except Exception as exc:  # a bug here must not end the instance's stream for good
            followed.log.serve_failed(exc, now=self._clock())
            self._pause(followed)

    def _pause(self, followed: _Followed) -> None:
        """After a failed pass: its sockets unwatched for ``ERROR_BACKOFF_S``, then served again."""
        for socket in _sockets(followed):
            self._unwatch(socket)
        if followed.timer is not None:
            followed.timer.cancel()
        assert self._loop is not None
        followed.timer = self._loop.call_later(ERROR_BACKOFF_S, self._resume, followed)

    def _resume(self, followed: _Followed) -> None:
        followed.timer = None
        if not followed.closed:
            self._start(followed)

    def _pass(self, followed: _Followed) -> None:
        """Drain both sockets, or apply one slice of a long batch; then act on time."""
        follower, channel = followed.follower, followed.channel
        follower.refill()
        drained = 0
        if follower.backlogged:
            follower.settle()
        else:
            drained = self._drain(followed, followed.socket, follower.on_live)
            if channel is not None:
                drained = max(drained, self._drain(followed, channel.socket, follower.on_replay, channel))
        if follower.backlogged:  # a long batch: a slice per pass, the rest waits in the pipe
            self._again(followed)
            return
        if channel is not None and channel.socket is not None and not follower.replaying:
            channel.close()  # between replays an instance holds no DEALER
        follower.expire()
        followed.monitor_disconnects()
        if followed.reconnect_at is not None and time.monotonic() >= followed.reconnect_at:
            followed.reconnect()
        if drained >= self._max_drain or _readable(followed.socket) or _readable(_replay_socket(followed)):
            self._again(followed)
        self._arm(followed)

    def _arm(self, followed: _Followed) -> None:
        """A pass at the replay deadline or the reconnect, whichever is first."""
        waits = []
        deadline = followed.follower.deadline()
        if deadline is not None:
            waits.append(deadline - self._clock())
        if followed.reconnect_at is not None:
            waits.append(followed.reconnect_at - time.monotonic())
        if followed.timer is not None:
            followed.timer.cancel()
            followed.timer = None
        if waits and self._loop is not None:
            delay = max(0.0, min(waits)) + TIMER_SLACK_S
            followed.timer = self._loop.call_later(delay, self._timed, followed)

    def _drain(
        self,
        followed: _Followed,
        socket: zmq.Socket[Any] | None,
        handle: Callable[[list[bytes]], None],
        channel: _DealerChannel | None = None,
    ) -> int:
        """Up to ``max_drain`` messages of one socket. The follower may give a replay up
        mid-drain, which closes ``channel``'s DEALER: the old one is not read again."""
        received = 0
        while socket is not None and received < self._max_drain and not followed.closed:
            if followed.follower.backlogged:  # applied first; the rest waits in the pipe
                break
            if channel is not None and channel.socket is not socket:
                break
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            received += 1
            handle(frames)
        return received


def _sockets(followed: _Followed) -> list[zmq.Socket[Any]]:
    """The sockets the loop watches for ``followed``: its SUB, its monitor, a replay DEALER if open."""
    replay = _replay_socket(followed)
    return (
        [followed.socket, followed.monitor] if replay is None else [followed.socket, followed.monitor, replay]
    )


def _replay_socket(followed: _Followed) -> zmq.Socket[Any] | None:
    return followed.channel.socket if followed.channel is not None else None


def _readable(socket: zmq.Socket[Any] | None) -> bool:
    """A message waits (libzmq's descriptor will not signal it again)."""
    return socket is not None and not socket.closed and bool(int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _close_sub(socket: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
    with contextlib.suppress(zmq.ZMQError):
        socket.monitor(None, 0)
    monitor.close(linger=0)
    socket.close(linger=0)
