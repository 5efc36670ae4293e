"""A worker process: announce the model card and serve the request plane.

The worker owns two sockets. A ROUTER bound on a random port is its request plane (advertised in
every announce as ``endpoint``); a ``CardPublisher`` announces the card on the discovery plane.
The request loop is a dispatcher on message type: ``FetchFile`` and ``Call`` (the non-streamed
kinds, ``worker.calls``) always, plus Generate / Cancel / Ping when the worker runs an engine
(``GenerationServer``, in ``worker.generate``).

With KV events, every announce also carries where the engine publishes them (``kv_events``):
either a fixed address (a real engine's publisher, ``register``) or the bound addresses of a
``KvPublisher`` the worker starts and closes itself (the mock engine's).

Stopping is graceful in Dynamo's order: withdraw the card first (frontends stop routing here),
then drain (new Generate gets a retryable 503, in-flight requests may finish for
``drain_timeout_s``), then cancel what is left, close the KV publisher (the drained requests'
last events are out) and close the request plane. A worker whose engine died or hung
(``engine_stalled``, the ``EngineWatchdog``) refuses new work at once and does not wait: nothing in
flight would finish, so its requests get their 503 (and move) right after the withdraw.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog
import zmq
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.announcing import Announcing
from dynamo_prep.discovery.files import FileServer
from dynamo_prep.discovery.publisher import STOP_LINGER_MS, CardPublisher
from dynamo_prep.engines.base import KvPublisher
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.calls import Echo
from dynamo_prep.protocol.discovery import (
    KvEventsEndpoint,
)
from dynamo_prep.protocol.wire import Call, Cancel, ErrorReply, FetchFile, Generate, Ping
from dynamo_prep.worker.calls import CallServer, echo
from dynamo_prep.worker.config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_ENDPOINT_HOST,
    DEFAULT_ENGINE_STALL_TIMEOUT_S,
    WorkerConfig,
)
from dynamo_prep.worker.generate import GenerationServer, Reply
from dynamo_prep.worker.metrics import MetricsServer, WorkerMetrics
from dynamo_prep.worker.watchdog import EngineWatchdog

__all__ = ["STOP_TIMEOUT_S", "RequestDispatcher", "Worker"]

log = structlog.get_logger("dynamo_prep.worker")

STOP_TIMEOUT_S = 5.0
ROUTER_LINGER_MS = 100
# A reply to a frontend whose queue is full is tried again after this long.
FULL_RETRY_S = 0.001
# Requests taken per wake of the request plane before the loop runs anything else.
RECV_BATCH = 256

M = TypeVar("M")
Handler = Callable[[Any, Reply], Awaitable[None]]


class RequestDispatcher:
    """Routes each decoded request-plane message to the handler registered for its type.

    A handler gets the message and a ``reply`` coroutine bound to the requesting peer; it may
    reply zero, one or many times (streaming). Handlers run inline in the receive loop, so
    anything long must spawn its own task.
    """

    def __init__(self) -> None:
        self._handlers: dict[type[Any], Handler] = {}

    def register(self, kind: type[M], handler: Callable[[M, Reply], Awaitable[None]]) -> None:
        self._handlers[kind] = handler

    async def dispatch(self, payload: bytes, reply: Reply) -> None:
        try:
            message = wire.to_worker_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            log.warning("request_rejected", reason="invalid", error=str(exc)[:200])
            await reply(ErrorReply(request_id="", code=400, message="invalid request"))
            return
        handler = self._handlers.get(type(message))
        if handler is None:
            await reply(ErrorReply(request_id=message.request_id, code=400, message="unsupported request"))
            return
        try:
            await handler(message, reply)
        except Exception as exc:  # one bad request must not take the request plane down
            log.exception("request_failed", kind=type(message).__name__, request_id=message.request_id)
            await reply(ErrorReply(request_id=message.request_id, code=500, message=type(exc).__name__))


class Worker:
    """One worker instance: request-plane ROUTER plus card publisher, started and stopped together.

    ``kv_events`` (a real engine's publisher address) or ``kv_publisher`` (started here, its bound
    addresses advertised), not both.
    """

    def __init__(
        self,
        card: ModelDeploymentCard,
        model_dir: Path,
        *,
        announcing: Announcing,
        endpoint_host: str = DEFAULT_ENDPOINT_HOST,
        instance_id: str | None = None,
        context: zmq.asyncio.Context | None = None,
        generation: GenerationServer | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        metrics: WorkerMetrics | None = None,
        metrics_port: int | None = None,
        kv_events: KvEventsEndpoint | None = None,
        kv_publisher: KvPublisher | None = None,
        engine_stall_timeout_s: float = DEFAULT_ENGINE_STALL_TIMEOUT_S,
    ) -> None:
        if kv_events is not None and kv_publisher is not None:
            raise ValueError("give kv_events (a fixed address) or kv_publisher (started here), not both")
        self.card = card
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self.instance_id = instance_id or uuid.uuid4().hex
        self.dispatcher = RequestDispatcher()
        self.files = FileServer(card, model_dir)
        self.dispatcher.register(FetchFile, self._fetch_file)
        self.calls = CallServer()
        self.calls.register(Echo, echo)
        self.dispatcher.register(Call, self.calls.on_call)
        self.dispatcher.register(Cancel, self.calls.cancelling(None))
        self.generation = generation
        self.drain_timeout_s = drain_timeout_s
        self.watchdog = (
            EngineWatchdog(generation, engine_stall_timeout_s)
            if generation is not None and engine_stall_timeout_s > 0
            else None
        )
        if generation is not None:
            self.metrics.track_inflight(lambda: generation.in_flight)
            self.dispatcher.register(Generate, self.metrics.counting_generate(generation.on_generate))
            self.dispatcher.register(Cancel, self.calls.cancelling(generation.on_cancel))
            self.dispatcher.register(Ping, generation.on_ping)
        self.announcing = announcing
        self._endpoint_host = endpoint_host
        self._context = context or zmq.asyncio.Context.instance()
        self._router: _RequestPlane | None = None
        self._publisher: CardPublisher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: asyncio.Task[None] | None = None
        self._metrics_port = metrics_port
        self.metrics_server: MetricsServer | None = None
        self.kv_events = kv_events
        self.kv_publisher = kv_publisher
        self.endpoint = ""

    @classmethod
    def from_config(
        cls,
        config: WorkerConfig,
        card: ModelDeploymentCard,
        context: zmq.asyncio.Context,
        generation: GenerationServer,
        metrics: WorkerMetrics,
        *,
        kv_events: KvEventsEndpoint | None = None,
        kv_publisher: KvPublisher | None = None,
    ) -> Worker:
        """The worker ``dynamo-prep worker`` runs: every option from ``config``, the engine's parts given."""
        return cls(
            card,
            config.model_dir,
            announcing=config.announcing,
            endpoint_host=config.endpoint_host,
            context=context,
            generation=generation,
            drain_timeout_s=config.drain_timeout_s,
            metrics=metrics,
            metrics_port=config.metrics_port,
            kv_events=kv_events,
            kv_publisher=kv_publisher,
            engine_stall_timeout_s=config.engine_stall_timeout_s,
        )

    async def start(self) -> None:
        """Bind the request plane (the advertised endpoint is the real bound address)."""
        router: zmq.Socket[bytes] = zmq.Context.shadow(self._context.underlying).socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, ROUTER_LINGER_MS)
        # A reply to a frontend whose queue is full waits for room (the stream waits, its engine
        # merges its steps) instead of being dropped, as a plain ROUTER would drop it.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            router.bind(f"tcp://{self._endpoint_host}:*")
        except zmq.ZMQError:
            router.close(linger=0)
            raise
        self._router = _RequestPlane(router)
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            if self._metrics_port is not None:
                self.metrics_server = MetricsServer(self.metrics.registry, self._metrics_port)
            if self.kv_publisher is not None:
                self.kv_events = self.kv_publisher.start()
        except (OSError, zmq.ZMQError):
            await self._close_bound()
            raise
        self._publisher = CardPublisher(
            self.card,
            endpoint=self.endpoint,
            announcing=self.announcing,
            instance_id=self.instance_id,
            context=self._context,
            kv_events=self.kv_events,
            load=self.generation.load if self.generation is not None else None,
        )
        structlog.contextvars.bind_contextvars(instance_id=self.instance_id, model=self.card.display_name)
        log.info(
            "worker_started",
            model=self.card.display_name,
            instance_id=self.instance_id,
            endpoint=self.endpoint,
            kv_events=None if self.kv_events is None else self.kv_events.endpoint,
            kv_replay_endpoint=None if self.kv_events is None else self.kv_events.replay_endpoint,
            declared_token=self.card.runtime_config.image_placeholder_token,
            legacy_runtime=dict(self.announcing.legacy_runtime or {}),
            mdcsum=self.card.mdcsum(),
        )

    async def run(self) -> None:
        """Serve and announce until ``stop()``; returns when both loops have ended."""
        if self._router is None or self._publisher is None:
            raise RuntimeError("Worker.start() must be awaited before run()")
        self._tasks = [
            asyncio.create_task(self._serve(self._router), name="request-plane"),
            asyncio.create_task(self._publisher.run(), name="card-publisher"),
        ]
        await asyncio.gather(*self._tasks)

    async def start_serving(self) -> None:
        """``start()`` then ``run()`` in the background, for an embedding process (stop with ``stop()``)."""
        await self.start()
        self._runner = asyncio.create_task(self.run(), name="worker")

    @property
    def stop_timeout_s(self) -> float:
        """The longest ``stop()`` may take: withdraw, drain, then close."""
        return self.drain_timeout_s + STOP_TIMEOUT_S + STOP_LINGER_MS / 1000

    async def engine_stalled(self) -> str:
        """Return (a reason) when the engine hung (the watchdog); never without one."""
        if self.watchdog is None:
            await asyncio.Event().wait()
        assert self.watchdog is not None
        return await self.watchdog.stalled()

    async def stop(self, *, drain: bool = True) -> None:
        """Withdraw the card first, drain in-flight generations, then close the request plane.

        The request plane keeps serving during the drain, so late requests get a 503 (retryable
        on another instance) and in-flight streams can still be cancelled. ``drain=False`` (the
        engine died or hung): new work is refused from now on, and what is in flight fails at once
        after the withdraw.
        """
        if not drain:  # a dying worker: new work gets a retryable 503 at once
            self.calls.draining = True
            if self.generation is not None:
                self.generation.draining = True
        if self._publisher is not None:
            await self._publisher.stop()
        drain_s = self.drain_timeout_s if drain else 0.0
        drains: list[Awaitable[object]] = [self.calls.drain(drain_s)]
        if self.generation is not None:
            drains.append(self.generation.drain(drain_s))
        await asyncio.gather(*drains)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
            self._runner = None
        await self._close_bound()
        log.info("worker_stopped", instance_id=self.instance_id)

    async def _close_bound(self) -> None:
        """Close what ``start()`` bound: the KV publisher, the request plane, the metrics server."""
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        if self._router is not None:
            self._router.close()
            self._router = None
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.close)
            self.metrics_server = None

    async def _serve(self, router: _RequestPlane) -> None:
        while True:
            frames = await router.recv()
            if len(frames) != 2:
                continue  # the frontend sends exactly one frame; the ROUTER adds the identity
            identity, payload = frames
            await self.dispatcher.dispatch(payload, router.replier(identity))

    async def _fetch_file(self, request: FetchFile, reply: Reply) -> None:
        await reply(await asyncio.to_thread(self.files.handle, request))


class _RequestPlane:
    """The worker's ROUTER as a plain socket: the event loop's reader callback takes what arrived,
    and replies are corked: those of one loop turn to one frontend leave as the parts of one
    multipart message (one ``send`` and one wake of ZeroMQ's I/O thread per engine step, however
    many streams it advanced; the frontend reads each part as a reply). No Future or task per reply.

    A frontend whose queue is full (ROUTER_MANDATORY says so) gets its corked replies again every
    ``FULL_RETRY_S``; meanwhile its streams wait at their next reply (their engine merges their
    steps). Replies to a frontend that is gone are dropped (``reply_dropped``, debug).

    ZeroMQ's descriptor is edge-triggered and any call on the socket (a send too) may consume the
    edge of requests that just arrived, so after sends the socket is looked at once more.
    """

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self.socket = socket
        self._loop = asyncio.get_running_loop()
        self._arrived: deque[list[bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._corked: dict[bytes, list[bytes]] = {}  # frontend identity -> replies of this turn
        self._full: dict[bytes, tuple[list[bytes], asyncio.Future[None]]] = {}  # waiting for room
        self._flushing = False  # a flush is queued
        self._closed = False
        self._loop.add_reader(socket.fileno(), self._take)

    async def recv(self) -> list[bytes]:
        while not self._arrived:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._arrived.popleft()

    def replier(self, identity: bytes) -> Reply:
        async def reply(message: wire.FromWorker) -> None:
            await self.send(identity, wire.encode(message))

        return reply

    async def send(self, identity: bytes, data: bytes) -> None:
        """Queue one reply for this turn's flush; wait first while that frontend's queue is full."""
        while (full := self._full.get(identity)) is not None:
            await asyncio.shield(full[1])
        if self._closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "the request plane is closed")
        corked = self._corked.get(identity)
        if corked is None:
            self._corked[identity] = [data]
            if not self._flushing:
                self._flushing = True
                self._loop.call_soon(self._flush)
        else:
            corked.append(data)

    def close(self) -> None:
        if self._closed:
            return
        self._flush()  # the last replies of a drained worker
        self._closed = True
        self._loop.remove_reader(self.socket.fileno())
        self.socket.close(linger=ROUTER_LINGER_MS)
        for _, room in self._full.values():
            if not room.done():
                room.set_result(None)
        self._full.clear()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()

    def _flush(self) -> None:
        self._flushing = False
        if self._closed:
            return
        corked, self._corked = self._corked, {}
        for identity, parts in corked.items():
            self._send(identity, parts)
        self._look()

    def _send(self, identity: bytes, parts: list[bytes]) -> None:
        """One multipart message; kept for a retry when that frontend's queue is full."""
        try:
            self.socket.send_multipart((identity, *parts), zmq.NOBLOCK)
        except zmq.Again:
            self._full[identity] = (parts, self._loop.create_future())
            self._loop.call_later(FULL_RETRY_S, self._retry, identity)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("reply_dropped", reason="frontend_gone", replies=len(parts))

    def _retry(self, identity: bytes) -> None:
        full = self._full.get(identity)
        if full is None or self._closed:
            return
        parts, room = full
        try:
            self.socket.send_multipart((identity, *parts), zmq.NOBLOCK)
        except zmq.Again:
            self._loop.call_later(FULL_RETRY_S, self._retry, identity)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("reply_dropped", reason="frontend_gone", replies=len(parts))
        del self._full[identity]
        room.set_result(None)
        self._look()

    def _look(self) -> None:
        events = self.socket.get(zmq.EVENTS)
        if isinstance(events, int) and events & zmq.POLLIN:
            self._take()

    def _take(self) -> None:
        """Take what arrived, at most ``RECV_BATCH`` messages before the loop runs the others."""
        if self._closed:
            return
        for _ in range(RECV_BATCH):
            try:
                self._arrived.append(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        else:
            self._loop.call_soon(self._look)
        if self._arrived and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
