"""Worker side of the discovery plane: announce this instance's card, withdraw it on stop.

The card is soft state: the full card is re-sent every heartbeat, so a dropped message (PUB drops
at the high-water mark) or a restarted frontend heals by itself. The socket is an XPUB that
*connects* to every discovery address (frontends or brokers bind), with ``XPUB_VERBOSE`` so every
subscription, even a repeated one forwarded by a broker, reaches us: we re-announce at once, and a
frontend that joins late converges without waiting a heartbeat (the "slow joiner" fix).

Heartbeats come from a thread of their own with a socket of its own, never from the event loop: a
loop busy for longer than the TTL (a slow request, a long decode, a collector pause) would miss
them, and every frontend would drop a worker that is only busy (docs/request-plane.md, "Busy, hung
and dead"). The thread needs the GIL for a few microseconds per heartbeat, which CPython hands it
within one switch interval however busy the loop is; only a process or host stopped for the TTL
(SIGSTOP, a starved machine) misses them. Each announce carries the engine's load (``load``, read
from plain counters the loop keeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket as stdsocket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.discovery.announcing import Announcing
from dynamo_prep.discovery.trust import apply_client_curve
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.discovery import (
    Announce,
    KvEventsEndpoint,
    Load,
    Withdraw,
    encode_message,
    topic,
)

__all__ = ["CardPublisher", "card_payload"]

log = structlog.get_logger("dynamo_prep.discovery")

STOP_LINGER_MS = 500
# Every message is a full card, so a deep queue only delays the newest one: keep it short.
SEND_HWM = 64
_SUBSCRIBE = b"\x01"


def card_payload(card: ModelDeploymentCard, legacy_runtime: Mapping[str, Any] | None = None) -> bytes:
    """The card's MessagePack bytes, optionally with legacy runtime_config keys added.

    ``legacy_runtime`` (e.g. ``{"expands_image_pad_token": True}``) emulates a worker that predates
    ``image_placeholder_token`` on the wire, to exercise rolling upgrades.
    """
    encoded = encode_card(card)
    if not legacy_runtime:
        return encoded
    fields = msgspec.msgpack.decode(encoded)
    fields["runtime_config"] = {**fields.get("runtime_config", {}), **legacy_runtime}
    return msgspec.msgpack.encode(fields)


class CardPublisher:
    """Announces one worker instance on one or more discovery addresses until ``stop()``.

    ``kv_events`` (where the instance's engine publishes its KV-cache events) goes into every
    announce, and so does ``load()`` (called on the publisher's thread: it must only read); None
    leaves the key out, so the payload is exactly wire v1's.
    """

    def __init__(
        self,
        card: ModelDeploymentCard,
        *,
        endpoint: str,
        announcing: Announcing,
        instance_id: str | None = None,
        context: zmq.asyncio.Context | None = None,
        kv_events: KvEventsEndpoint | None = None,
        load: Callable[[], Load] | None = None,
    ) -> None:
        if not announcing.discovery:
            raise ValueError("at least one discovery address is required")
        if announcing.heartbeat_s <= 0:
            raise ValueError(f"heartbeat must be positive, got {announcing.heartbeat_s}")
        self.card = card
        self.endpoint = endpoint
        self.discovery = list(announcing.discovery)
        self.namespace = announcing.namespace
        self.heartbeat_s = announcing.heartbeat_s
        self.ttl_ms = announcing.ttl_ms
        self.instance_id = instance_id or uuid.uuid4().hex
        self.kv_events = kv_events
        self._load = load
        self._topic = topic(announcing.namespace)
        self._card = msgspec.Raw(card_payload(card, announcing.legacy_runtime))
        self._curve = announcing.curve
        # The thread's sockets come from the same libzmq context (a plain-socket shadow of it).
        self._context: zmq.Context[Any] = zmq.Context.shadow(
            (context or zmq.asyncio.Context.instance()).underlying
        )
        self._seq = 0
        self._stopping = threading.Event()
        self._wake_read, self._wake_write = stdsocket.socketpair()  # stop() wakes the thread's poll
        self._closed = asyncio.Event()
        self._running = False

    @property
    def seq(self) -> int:
        """The last sequence number sent (0 before the first message)."""
        return self._seq

    async def run(self) -> None:
        """Announce now, on every heartbeat and on every new subscription; withdraw on ``stop()``.

        The work runs on the publisher's thread; this returns when it has withdrawn and closed (a
        cancelled ``run`` stops the thread the same way)."""
        if self._stopping.is_set():
            self._close_wake()
            return
        self._running = True
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        thread = threading.Thread(
            target=self._serve,
            args=(loop, finished),
            name=f"card-publisher-{self.instance_id[:8]}",
            daemon=True,
        )
        thread.start()
        try:
            await asyncio.shield(finished)
        except asyncio.CancelledError:
            self._wake()
            thread.join(STOP_LINGER_MS / 1000 + 1.0)
            raise
        finally:
            self._closed.set()
            self._close_wake()

    async def stop(self) -> None:
        """Send a withdraw and close (bounded linger); safe to call more than once."""
        self._wake()
        if self._running:
            await self._closed.wait()

    def _close_wake(self) -> None:
        self._wake_read.close()
        self._wake_write.close()

    def _wake(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\x00")

    # -- the publisher's thread ------------------------------------------------------------------

    def _serve(self, loop: asyncio.AbstractEventLoop, finished: asyncio.Future[None]) -> None:
        error: BaseException | None = None
        try:
            socket = self._open()
            try:
                log.info(
                    "publisher_started",
                    instance_id=self.instance_id,
                    discovery=self.discovery,
                    namespace=self.namespace,
                    heartbeat_s=self.heartbeat_s,
                    endpoint=self.endpoint,
                    kv_events=None if self.kv_events is None else self.kv_events.endpoint,
                    curve=self._curve is not None,
                )
                self._beat(socket)
                self._withdraw(socket)
            finally:
                socket.close(linger=STOP_LINGER_MS)
        except Exception as exc:  # reported to ``run``'s caller, on the loop
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(_settle, finished, error)

    def _open(self) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = self._context.socket(zmq.XPUB)
        socket.setsockopt(zmq.LINGER, STOP_LINGER_MS)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        # Detect a dead broker or frontend on half-open TCP and reconnect.
        socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if self._curve is not None:
            apply_client_curve(socket, self._curve)
        try:
            for address in self.discovery:
                socket.connect(address)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        return socket

    def _beat(self, socket: zmq.Socket[bytes]) -> None:
        """Announce at start, every heartbeat and on each new subscription, until ``stop()``."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wake_read.fileno(), zmq.POLLIN)
        self._announce(socket, reason="start")
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stopping.is_set():
            ready = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000))))
            if socket in ready and _drain_subscriptions(socket, self._topic):
                self._announce(socket, reason="subscription")
            if time.monotonic() >= next_beat and not self._stopping.is_set():
                self._announce(socket, reason="heartbeat")
                next_beat = max(next_beat + self.heartbeat_s, time.monotonic())

    def _announce(self, socket: zmq.Socket[bytes], *, reason: str) -> None:
        self._seq += 1
        message = Announce(
            instance_id=self.instance_id,
            seq=self._seq,
            sent_ms=now_ms(),
            ttl_ms=self.ttl_ms,
            endpoint=self.endpoint,
            card=self._card,
            kv_events=msgspec.UNSET if self.kv_events is None else self.kv_events,
            load=msgspec.UNSET if self._load is None else self._load(),
        )
        self._send(socket, encode_message(message))
        log.debug("card_announced", instance_id=self.instance_id, seq=self._seq, reason=reason)

    def _withdraw(self, socket: zmq.Socket[bytes]) -> None:
        self._seq += 1
        message = Withdraw(instance_id=self.instance_id, seq=self._seq, sent_ms=now_ms())
        self._send(socket, encode_message(message))
        log.info("card_withdrawn", instance_id=self.instance_id, seq=self._seq)

    def _send(self, socket: zmq.Socket[bytes], payload: bytes) -> None:
        # XPUB never blocks: at the high-water mark or without subscribers the message is dropped,
        # which the next heartbeat repairs.
        with contextlib.suppress(zmq.Again):
            socket.send_multipart([self._topic, payload], flags=zmq.NOBLOCK)


def _settle(finished: asyncio.Future[None], error: BaseException | None) -> None:
    if finished.done():
        return
    if error is None:
        finished.set_result(None)
    else:
        finished.set_exception(error)


def _drain_subscriptions(shadow: zmq.Socket[bytes], our_topic: bytes) -> bool:
    """Read every pending (un)subscription; True if one subscribes to a prefix of our topic."""
    subscribed = False
    while True:
        try:
            message = shadow.recv(zmq.NOBLOCK)
        except zmq.Again:
            return subscribed
        subscribed = subscribed or (message[:1] == _SUBSCRIBE and our_topic.startswith(message[1:]))
