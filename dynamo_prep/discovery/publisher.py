"""Worker side of the discovery plane: announce this instance's card, withdraw it on stop.

The card is soft state: the full card is re-sent every heartbeat, so a dropped message (PUB drops
at the high-water mark) or a restarted frontend heals by itself. The socket is an XPUB that
*connects* to every discovery address (frontends or brokers bind), with ``XPUB_VERBOSE`` so every
subscription, even a repeated one forwarded by a broker, reaches us: we re-announce at once, and a
frontend that joins late converges without waiting a heartbeat (the "slow joiner" fix).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.discovery.trust import ClientCurve, apply_client_curve
from dynamo_prep.protocol.discovery import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_NAMESPACE,
    DEFAULT_TTL_MS,
    Announce,
    KvEventsEndpoint,
    Withdraw,
    encode_message,
    now_ms,
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
    announce; None leaves the key out, so the payload is exactly wire v1's.
    """

    def __init__(
        self,
        card: ModelDeploymentCard,
        *,
        endpoint: str,
        discovery: Sequence[str],
        namespace: str = DEFAULT_NAMESPACE,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        ttl_ms: int = DEFAULT_TTL_MS,
        instance_id: str | None = None,
        legacy_runtime: Mapping[str, Any] | None = None,
        curve: ClientCurve | None = None,
        context: zmq.asyncio.Context | None = None,
        kv_events: KvEventsEndpoint | None = None,
    ) -> None:
        if not discovery:
            raise ValueError("at least one discovery address is required")
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat must be positive, got {heartbeat_s}")
        self.card = card
        self.endpoint = endpoint
        self.discovery = list(discovery)
        self.namespace = namespace
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = ttl_ms
        self.instance_id = instance_id or uuid.uuid4().hex
        self.kv_events = kv_events
        self._topic = topic(namespace)
        self._card = msgspec.Raw(card_payload(card, legacy_runtime))
        self._curve = curve
        self._context = context or zmq.asyncio.Context.instance()
        self._seq = 0
        self._socket: zmq.asyncio.Socket | None = None
        self._stopping = asyncio.Event()
        self._closed = asyncio.Event()
        self._running = False

    @property
    def seq(self) -> int:
        """The last sequence number sent (0 before the first message)."""
        return self._seq

    async def run(self) -> None:
        """Announce now, on every heartbeat and on every new subscription; withdraw on ``stop()``."""
        if self._stopping.is_set():
            return
        self._running = True
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
            await self._loop(socket)
            await self._withdraw(socket)
        finally:
            socket.close(linger=STOP_LINGER_MS)
            self._socket = None
            self._closed.set()

    async def stop(self) -> None:
        """Send a withdraw and close (bounded linger); safe to call more than once."""
        self._stopping.set()
        if self._running:
            await self._closed.wait()

    def _open(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.XPUB)
        socket.setsockopt(zmq.LINGER, STOP_LINGER_MS)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        # Detect a dead broker or frontend on half-open TCP and reconnect.
        socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if self._curve is not None:
            apply_client_curve(socket, self._curve)
        for address in self.discovery:
            socket.connect(address)
        self._socket = socket
        return socket

    async def _loop(self, socket: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        # asyncio sockets return Futures even for NOBLOCK: drain through a synchronous shadow.
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        poller = zmq.asyncio.Poller()
        poller.register(socket, zmq.POLLIN)
        await self._announce(socket, reason="start")
        next_beat = loop.time() + self.heartbeat_s
        while not self._stopping.is_set():
            readable = await self._wait_readable(poller, next_beat - loop.time())
            if readable and _drain_subscriptions(shadow, self._topic):
                await self._announce(socket, reason="subscription")
            if loop.time() >= next_beat:
                await self._announce(socket, reason="heartbeat")
                next_beat = max(next_beat + self.heartbeat_s, loop.time())

    async def _wait_readable(self, poller: zmq.asyncio.Poller, timeout_s: float) -> bool:
        """Wait for a subscription message, the next heartbeat or ``stop()``, whichever is first."""
        poll = asyncio.ensure_future(poller.poll(max(0, int(timeout_s * 1000))))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({poll, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (poll, stopping):
                waiter.cancel()
        return poll.done() and not poll.cancelled() and bool(poll.result())

    async def _announce(self, socket: zmq.asyncio.Socket, *, reason: str) -> None:
        self._seq += 1
        message = Announce(
            instance_id=self.instance_id,
            seq=self._seq,
            sent_ms=now_ms(),
            ttl_ms=self.ttl_ms,
            endpoint=self.endpoint,
            card=self._card,
            kv_events=msgspec.UNSET if self.kv_events is None else self.kv_events,
        )
        await self._send(socket, encode_message(message))
        log.debug("card_announced", instance_id=self.instance_id, seq=self._seq, reason=reason)

    async def _withdraw(self, socket: zmq.asyncio.Socket) -> None:
        self._seq += 1
        message = Withdraw(instance_id=self.instance_id, seq=self._seq, sent_ms=now_ms())
        await self._send(socket, encode_message(message))
        log.info("card_withdrawn", instance_id=self.instance_id, seq=self._seq)

    async def _send(self, socket: zmq.asyncio.Socket, payload: bytes) -> None:
        # XPUB never blocks: at the high-water mark or without subscribers the message is dropped,
        # which the next heartbeat repairs.
        with contextlib.suppress(zmq.Again):
            await socket.send_multipart([self._topic, payload], flags=zmq.NOBLOCK)


def _drain_subscriptions(shadow: zmq.Socket[bytes], our_topic: bytes) -> bool:
    """Read every pending (un)subscription; True if one subscribes to a prefix of our topic."""
    subscribed = False
    while True:
        try:
            message = shadow.recv(zmq.NOBLOCK)
        except zmq.Again:
            return subscribed
        subscribed = subscribed or (message[:1] == _SUBSCRIBE and our_topic.startswith(message[1:]))
