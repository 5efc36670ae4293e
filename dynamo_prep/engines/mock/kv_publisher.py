"""Worker side of the KV-event plane: what a vLLM engine runs, for the mock engine.

vLLM's publisher semantics (``vllm/distributed/kv_events.py``): a PUB bound to ``endpoint`` sends
``[topic, seq, payload]`` per ``publish`` (seq from 0), a ring buffer keeps the last
``buffer_steps`` encoded batches, and a ROUTER bound to ``replay_endpoint`` answers ``[b"", start]``
with one ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start``, then the end marker.

It runs as a task on the worker's event loop, not in a thread as vLLM's does: the engine calls
``publish`` from that loop, so the ring buffer and the sockets have one owner and need no lock or
queue. ``publish`` never waits (PUB drops at its high-water mark; subscribers see the gap and
replay). A replay answers from a snapshot of the buffer and yields to the loop every
``REPLAY_CHUNK`` messages, so publishing is never held up by more than one chunk. The ROUTER is
``ROUTER_MANDATORY``: a reply that does not fit the peer's pipe is retried for ``REPLAY_SEND_S``
instead of silently dropped, and one to a peer that left ends that replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.logging import DETAIL_CHARS, RateLimiter
from dynamo_prep.protocol.discovery import KvEventsEndpoint
from dynamo_prep.protocol.kv_events import (
    END_SEQ,
    KVEvent,
    KVEventBatch,
    KvEventDecodeError,
    decode_seq,
    encode_batch,
    encode_seq,
)

__all__ = ["DEFAULT_BUFFER_STEPS", "DEFAULT_HWM", "KvEventPublisher"]

log = structlog.get_logger("dynamo_prep.engines")

DEFAULT_BUFFER_STEPS: Final = 10_000
DEFAULT_HWM: Final = 100_000
CLOSE_LINGER_MS: Final = 500
REPLAY_CHUNK: Final = 256
REPLAY_SEND_S: Final = 5.0
_RETRY_S: Final = 0.002
_MAX_REQUEST_BYTES: Final = 64


class KvEventPublisher:
    """Publishes one engine's KV-cache events and serves replays of the recent ones.

    ``start()`` binds both sockets (``tcp://127.0.0.1:*`` picks a free port) and returns the real
    bound addresses, ready for the announce's ``kv_events``. Every method runs on the event loop.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        *,
        replay_endpoint: str | None = "tcp://127.0.0.1:*",
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        data_parallel_rank: int | None = None,
        shape: Literal["map", "array"] = "map",
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be at least 1, got {buffer_steps}")
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.data_parallel_rank = data_parallel_rank
        self.shape: Literal["map", "array"] = shape
        self._bind = endpoint
        self._replay_bind = replay_endpoint
        self._hwm = hwm
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._context = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._pub_socket: zmq.asyncio.Socket | None = None
        self._pub: zmq.Socket[Any] | None = None  # its synchronous shadow: publish() never awaits
        self._router: zmq.asyncio.Socket | None = None
        self._endpoints: KvEventsEndpoint | None = None
        self._task: asyncio.Task[None] | None = None
        self._rejected: Counter[str] = Counter()
        self._limiter = RateLimiter()

    @property
    def endpoints(self) -> KvEventsEndpoint:
        """The bound addresses (after ``start()``)."""
        if self._endpoints is None:
            raise RuntimeError("start() the publisher first")
        return self._endpoints

    @property
    def next_seq(self) -> int:
        """The seq the next ``publish`` will carry."""
        return self._seq

    def start(self) -> KvEventsEndpoint:
        """Bind the PUB and the replay ROUTER and start serving replays (idempotent)."""
        if self._endpoints is not None:
            return self._endpoints
        pub = self._context.socket(zmq.PUB)
        sockets: list[zmq.Socket[Any]] = [pub]
        try:
            pub.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.bind(self._bind)
            endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            replay = None
            if self._replay_bind is not None:
                router = self._context.socket(zmq.ROUTER)
                sockets.append(router)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.setsockopt(zmq.SNDHWM, self.buffer_steps + REPLAY_CHUNK)
                router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
                router.bind(self._replay_bind)
                replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._router = router
        except BaseException:
            for socket in sockets:
                socket.close(linger=0)
            self._router = None
            raise
        self._pub_socket = pub
        self._pub = zmq.Socket.shadow(pub.underlying)
        self._endpoints = KvEventsEndpoint(endpoint=endpoint, replay_endpoint=replay, topic=self.topic)
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve(self._router), name="kv-replay")
        log.info("kv_publisher_started", endpoint=endpoint, replay_endpoint=replay, topic=self.topic)
        return self._endpoints

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Send one batch (never waits) and keep it for replays; returns its seq."""
        pub = self._pub
        if pub is None:
            raise RuntimeError("start() the publisher first")
        seq = self._seq
        self._seq += 1
        batch = KVEventBatch(
            ts=time.monotonic(), events=list(events), data_parallel_rank=self.data_parallel_rank
        )
        seq_frame, payload = encode_seq(seq), encode_batch(batch, shape=self.shape)
        self._buffer.append((seq, seq_frame, payload))
        with contextlib.suppress(zmq.Again):  # PUB drops at the HWM rather than raise; be sure
            pub.send_multipart([self._topic, seq_frame, payload], zmq.NOBLOCK)
        return seq

    async def close(self) -> None:
        """Stop serving replays and close; the PUB lingers at most ``CLOSE_LINGER_MS`` to flush."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._pub_socket is not None:
            self._pub_socket.close(linger=CLOSE_LINGER_MS)
            self._pub_socket = None
            self._pub = None
            log.info("kv_publisher_closed", published=self._seq)

    # -- replay --------------------------------------------------------------------------------

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        shadow: zmq.Socket[Any] = zmq.Socket.shadow(router.underlying)
        while True:
            await router.poll()
            while True:
                try:
                    frames = shadow.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                start = self._parse_request(frames)
                if start is not None:
                    await self._answer(shadow, frames[0], start)

    def _parse_request(self, frames: list[bytes]) -> int | None:
        """``[identity, b"", start_seq]`` (a DEALER's or a REQ's); anything else is dropped.

        A peer can send these at message rate: at most one line per reason per second, with the
        running total and how many were suppressed.
        """
        try:
            if len(frames) != 3 or frames[1] != b"":
                raise KvEventDecodeError("frame_count", f"{len(frames)} frames, expected [b'', start_seq]")
            return decode_seq(frames[2])
        except KvEventDecodeError as exc:
            self._rejected[exc.reason] += 1
            suppressed = self._limiter.allow(exc.reason, self._clock())
            if suppressed is not None:
                log.warning(
                    "kv_replay_request_rejected",
                    reason=exc.reason,
                    detail=exc.detail[:DETAIL_CHARS],
                    total=self._rejected[exc.reason],
                    suppressed=suppressed,
                )
            return None

    async def _answer(self, router: zmq.Socket[Any], identity: bytes, start: int) -> None:
        """Every buffered batch from ``start`` on, then the end marker, from a snapshot of the buffer."""
        snapshot = [entry for entry in self._buffer if entry[0] >= start]
        sent = 0
        try:
            for _, seq_frame, payload in snapshot:
                await self._send(router, [identity, b"", self._topic, seq_frame, payload])
                sent += 1
                if sent % REPLAY_CHUNK == 0:
                    await asyncio.sleep(0)
            await self._send(router, [identity, b"", b"", END_SEQ, b""])
        except (zmq.ZMQError, TimeoutError) as exc:  # the peer left or stopped reading
            log.warning("kv_replay_abandoned", start_seq=start, sent=sent, error=str(exc))
            return
        log.debug("kv_replay_served", start_seq=start, batches=sent)

    async def _send(self, router: zmq.Socket[Any], frames: list[bytes]) -> None:
        """Send, waiting up to ``REPLAY_SEND_S`` while the peer's pipe is full."""
        deadline = self._clock() + REPLAY_SEND_S
        while True:
            try:
                router.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._clock() >= deadline:
                    raise TimeoutError(f"replay peer did not read for {REPLAY_SEND_S} s") from None
                await asyncio.sleep(_RETRY_S)
