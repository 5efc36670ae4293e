"""Frontend side of the discovery plane: one SUB socket in, the live model catalog out.

The loop is ``await poll()`` (bounded by the next instance deadline), then a drain of up to
``max_drain`` messages (and at most ``MAX_DRAIN_S`` of the event loop's time) through a *shadow
synchronous* socket: ``zmq.asyncio`` allocates a Future per ``recv``, which the drain does not
need. Every message goes through the pure ``DiscoveryRegistry``; its events become log lines,
catalog updates and model builds. Builds run in a thread, so the socket keeps being serviced (a
bound SUB only sends its subscription to a new publisher when its owner touches it). Nothing a
peer sends can stop the loop: bad messages are counted and logged at most once per reason per
second; a listener that raises (the KV router with no socket left, a bug) is logged and counted,
and the plane goes on.

Each live instance reaches the catalog as the registry's ``Instance`` record (endpoint, declared
token, KV-event address), unchanged. When the set of declarations in a model's pool changes the
watcher logs ``pool_composition_changed``; when an instance expires it calls
``on_endpoint_expired``, so the request plane fails that worker's streams at once instead of
waiting for its stall timeout, unless its channel still delivers (docs/request-plane.md, "Busy,
hung and dead"). The load an admitted instance's announce reports goes to ``on_load``.

Metrics (``DiscoveryMetrics``, in the registry the frontend hands in) are updated next to the
log lines, from the same registry events, so ``/metrics`` and the logs never disagree.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.builder import ModelBuilder
from dynamo_prep.discovery.builds import ModelBuilds
from dynamo_prep.discovery.catalog import ModelCatalog
from dynamo_prep.discovery.eventlog import DiscoveryLog
from dynamo_prep.discovery.metrics import DiscoveryMetrics
from dynamo_prep.discovery.probing import NewcomerProbe, Prober
from dynamo_prep.discovery.registry import (
    CardRejected,
    ChecksumMismatch,
    DiscoveryRegistry,
    InstanceAdded,
    InstanceRemoved,
    KeyMismatch,
    LegacyDowngrade,
    ModelFirstSeen,
    ModelRemoved,
    RegistryEvent,
    RuntimeConfigConflict,
)
from dynamo_prep.discovery.trust import (
    AllowList,
    ServerCurve,
    apply_server_curve,
    authenticated_key,
    start_authenticator,
)
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.discovery import (
    DEFAULT_NAMESPACE,
    Announce,
    DiscoveryDecodeError,
    Instance,
    Load,
    declared_label,
    decode_message,
    topic,
)

__all__ = ["DiscoveryWatcher", "InstanceListener"]
_T = TypeVar("_T")
MAX_DRAIN_PER_WAKE = 512
# A drain also stops after this long: under a flood of new instances (~0.1 ms each: registry, log
# line, metrics) 512 messages would hold the event loop for 50 ms and more, /live and streams with it.
MAX_DRAIN_S = 0.002
MAX_POLL_S = 1.0
# After a drain, wait this long before the next poll (bounds the wake rate, adds at most this latency).
COALESCE_S = 0.005
STALL_TOLERANCE_S = 0.5
STALL_GRACE_S = 0.5
RECV_HWM = 10_000
# Frames above this are refused by libzmq (the peer is disconnected): a memory bound, far above
# the 1 MiB payload limit so that oversize payloads still arrive and are counted as too_large.
MAX_FRAME_BYTES = 16 << 20


class InstanceListener(Protocol):
    """Told about every admitted instance (a new one, or a live one's changed record) and every
    removal, with the same ``Instance`` records the catalog gets (e.g. the KV router)."""

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None: ...

    def instance_removed(self, model: str, instance: Instance) -> None: ...


class DiscoveryWatcher:
    """Subscribes to one namespace, tracks live instances, keeps ``catalog`` current.

    ``bind`` addresses make this the embedded plane (workers connect here); ``connect``
    addresses are brokers' XPUB sockets. ``curve`` makes the bound socket a CURVE server whose
    allow-list decides who may announce; each instance is then bound to its announcing key.
    """

    def __init__(
        self,
        *,
        builder: ModelBuilder,
        bind: Sequence[str] = (),
        connect: Sequence[str] = (),
        namespace: str = DEFAULT_NAMESPACE,
        curve: ServerCurve | None = None,
        catalog: ModelCatalog | None = None,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_drain: int = MAX_DRAIN_PER_WAKE,
        on_endpoint_expired: Callable[[str], None] | None = None,
        on_load: Callable[[str, Load], None] | None = None,
        on_model_removed: Callable[[str], None] | None = None,
        metrics: DiscoveryMetrics | None = None,
        listeners: Sequence[InstanceListener] = (),
        prober: Prober | None = None,
        registry: DiscoveryRegistry | None = None,
    ) -> None:
        if not bind and not connect:
            raise ValueError("the discovery watcher needs at least one bind or connect address")
        if curve is not None and connect:
            raise ValueError("frontend CURVE secures its bound plane; with brokers, key the brokers")
        self.namespace = namespace
        self.bind = list(bind)
        self.connect = list(connect)
        self.curve = curve
        self._registry = registry if registry is not None else DiscoveryRegistry()
        self.catalog = catalog or ModelCatalog()
        self.counters: Counter[str] = Counter()
        self.metrics = metrics if metrics is not None else DiscoveryMetrics()
        self.addresses: list[str] = []
        self._context = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._tick: float | None = None  # real time of the last wake, to notice this process stalling
        self._expire_after = 0.0  # after a stall, no expiry before this (clock time)
        self._max_drain = max_drain
        self._topic = topic(namespace)
        self._log = DiscoveryLog(namespace)
        self._builds = ModelBuilds(
            builder,
            self.registry,
            self.catalog,
            self.metrics,
            self._log,
            clock=clock,
            on_published=self._note_composition,
        )
        self._socket: zmq.asyncio.Socket | None = None
        self._shadow: zmq.Socket[Any] | None = None
        self._authenticator: ThreadAuthenticator | None = None
        self._allow: AllowList | None = None
        self._on_endpoint_expired = on_endpoint_expired
        self._on_load = on_load  # (instance_id, load) of each fresh announce of an admitted instance
        self._on_model_removed = on_model_removed  # called with the mdcsum: its cached files may go
        self._listeners = tuple(listeners)
        # a newcomer the full table refused is let in once its endpoint answers the request plane
        self._probe = NewcomerProbe(prober, self.registry, namespace) if prober is not None else None
        self._compositions: dict[str, tuple[str, ...]] = {}  # sorted labels (no GC-tracked set per model)
        self._pool_log = structlog.get_logger("dynamo_prep.discovery").bind(namespace=namespace)
        self._limiter = RateLimiter()

    @property
    def registry(self) -> DiscoveryRegistry:
        """The instance table (its builds and probes hold it too: given once, never replaced)."""
        return self._registry

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Create, secure, subscribe and bind/connect the SUB socket (idempotent)."""
        if self._socket is not None:
            return
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)  # a SUB has nothing worth flushing at exit
        socket.setsockopt(zmq.RCVHWM, RECV_HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._socket = socket
        try:
            if self.curve is not None:
                self._authenticator = start_authenticator(self._context, self.curve.allow_dir)
                self._allow = AllowList(self.curve.allow_dir, self._authenticator)
                apply_server_curve(socket, self.curve)
            socket.setsockopt(zmq.SUBSCRIBE, self._topic)
            for address in self.bind:
                socket.bind(address)
                self.addresses.append(socket.getsockopt_string(zmq.LAST_ENDPOINT))
            for address in self.connect:
                socket.connect(address)
                self.addresses.append(address)
        except BaseException:
            self.close()
            raise
        self._shadow = zmq.Socket.shadow(socket.underlying)
        if self.curve is None:
            self._log.plane_open(self.addresses, bound=bool(self.bind))

    async def run(self) -> None:
        """Serve the socket until cancelled; closes everything on the way out."""
        self.open()
        try:
            while True:
                await self.step()
        finally:
            self.close()

    async def step(self) -> None:
        """One wake: wait for messages or the next deadline, drain, expire."""
        socket = self._socket
        if socket is None:
            raise RuntimeError("open() the watcher first")
        timeout_ms = self._poll_timeout_ms()
        if await socket.poll(timeout_ms):  # flags default to POLLIN
            flooded = self._drain()
            # Under a flood, only yield (builds and other tasks run). Otherwise let the next messages
            # gather for a moment: a first message is handled at once, but steady heartbeats cost one
            # wake per batch instead of one per message (half the CPU at 1,000/s; benchmarks/scale.py).
            await asyncio.sleep(0 if flooded else COALESCE_S)
        self._notice_stall(timeout_ms / 1000 + COALESCE_S)
        # News before expiry: after a stall the poll can time out, or the sleep overrun, with fresh
        # announcements waiting; expiring first would drop every instance. Under a flood, the rest
        # waits for the next wake (the poll yields first).
        self._drain()
        if self._clock() >= self._expire_after:
            self._handle(self.registry.expire(self._clock()))
        self._follow_allow_list()

    def _follow_allow_list(self) -> None:
        """Keys removed from the allow-list: their instances go at once, their messages are refused."""
        removed = self._allow.poll() if self._allow is not None else frozenset()
        if removed and self._allow is not None:
            self._pool_log.warning("curve_keys_revoked", keys=sorted(removed), allowed=len(self._allow.keys))
            self._handle(self.registry.revoke(removed))

    def _notice_stall(self, planned_s: float) -> None:
        """A wake far later than planned means this process was frozen or starved (SIGSTOP, swap, CPU
        starvation): announcements may still sit in the kernel's buffers, not yet read by ZeroMQ's I/O
        thread, so expiry waits ``STALL_GRACE_S`` for them instead of dropping every instance."""
        now = time.monotonic()  # a freeze is measured in real time, whatever clock the TTLs use
        if self._tick is not None and now - self._tick - planned_s > STALL_TOLERANCE_S:
            self._expire_after = self._clock() + STALL_GRACE_S
            self._pool_log.warning("discovery_watcher_stalled", stalled_s=round(now - self._tick, 3))
        self._tick = now

    def close(self) -> None:
        """Cancel builds and a probe, close the socket (LINGER 0) and stop the authenticator."""
        self._builds.close()
        if self._probe is not None:
            self._probe.close()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            self._shadow = None
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    def _poll_timeout_ms(self) -> int:
        deadline = self.registry.next_deadline()
        if deadline is not None:
            deadline = max(deadline, self._expire_after)
        wait_s = MAX_POLL_S if deadline is None else min(MAX_POLL_S, max(0.0, deadline - self._clock()))
        return math.ceil(wait_s * 1000)

    # -- receiving ---------------------------------------------------------------------------

    def _drain(self) -> bool:
        """Receive without Futures until the socket is empty (False), or ``max_drain`` messages or
        ``MAX_DRAIN_S`` are reached (True: more may be waiting)."""
        shadow = self._shadow
        assert shadow is not None
        received = 0
        deadline = time.monotonic() + MAX_DRAIN_S
        while received < self._max_drain:
            try:
                frames = shadow.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            received += 1
            self._on_frames(frames)
            if time.monotonic() >= deadline:
                return True
        return True

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.counters["messages"] += 1
        now = self._clock()
        if len(frames) != 2:
            self.metrics.messages.labels(kind="invalid").inc()
            self._reject("frame_count", f"{len(frames)} frames, expected [topic, payload]", now)
            return
        if frames[0].bytes != self._topic:
            self.counters["other_topic"] += 1  # a longer namespace sharing our prefix: not ours
            self.metrics.messages.labels(kind="other_topic").inc()
            return
        try:
            message = decode_message(frames[1].buffer)
        except DiscoveryDecodeError as exc:
            self.metrics.messages.labels(kind="invalid").inc()
            self._reject(exc.reason, exc.detail, now)
            return
        self.metrics.messages.labels(kind="announce" if isinstance(message, Announce) else "withdraw").inc()
        user_id = authenticated_key(frames[0]) if self.curve is not None else None
        if self._allow is not None and not self._allow.allows(user_id):
            self._reject("revoked_key", f"a key no longer in the allow-list: {user_id}", now)
            return
        events = self.registry.apply(message, now=now, user_id=user_id)
        self._handle(events)
        if isinstance(message, Announce):
            self._note_load(message)
            self._builds.retry(message.instance_id, message.endpoint, now)
            if self._probe is not None and any(
                isinstance(e, CardRejected) and e.reason == "too_many_instances" for e in events
            ):
                self._probe.maybe(message.instance_id, message.endpoint, now)

    def _note_load(self, message: Announce) -> None:
        """Hand on the load an admitted instance reports, from news only (not a duplicate or stale)."""
        load = message.load
        if self._on_load is None or isinstance(load, msgspec.UnsetType):
            return
        if self.registry.serving(message.instance_id, message.seq):
            self._on_load(message.instance_id, load)

    def _reject(self, reason: str, detail: str, now: float) -> None:
        """Count a refused message; the log line is rate-limited per reason."""
        self.counters[reason] += 1
        self.metrics.rejected.labels(reason=reason).inc()
        self._log.card_rejected(reason, detail, total=self.counters[reason], now=now)

    # -- registry events ---------------------------------------------------------------------

    def _handle(self, events: list[RegistryEvent]) -> None:
        for event in events:
            self._on_event(event)
            self._count(event)

    def _count(self, event: RegistryEvent) -> None:
        """Metrics for one registry event (the log lines are written by ``_on_event``)."""
        metrics = self.metrics
        match event:
            case InstanceAdded() | InstanceRemoved() | ModelRemoved():
                metrics.set_model(event.model, self.registry.instance_count(event.model))
                metrics.models.set(self.registry.model_count())
            case ChecksumMismatch():
                metrics.rejected.labels(reason="checksum_mismatch").inc()
            case KeyMismatch():
                metrics.rejected.labels(reason="curve_key_mismatch").inc()
            case RuntimeConfigConflict():
                metrics.runtime_config_conflicts.inc(len(event.fields))
            case LegacyDowngrade():
                metrics.legacy_downgrades.inc()

    def _on_event(self, event: RegistryEvent) -> None:
        match event:
            case InstanceAdded():
                self._on_instance(event)
            case InstanceRemoved():
                self.catalog.remove_instance(event.model, event.instance.instance_id)
                for listener in self._listeners:
                    self._tell(listener.instance_removed, event.model, event.instance)
                self._log.instance_removed(event)
                if event.reason == "expired" and self._on_endpoint_expired is not None:
                    self._on_endpoint_expired(event.instance.endpoint)  # dead, unless it still delivers
                self._note_composition(event.model)
            case ModelFirstSeen():
                self.catalog.mark_pending(event.model)
                self._builds.first_seen(event)
            case ModelRemoved():
                self.catalog.remove(event.model)
                self._builds.forget(event.model)  # an in-flight build sees this and drops its result
                self._log.model_removed(event)
                self._note_composition(event.model)
                if self._on_model_removed is not None:
                    self._on_model_removed(event.mdcsum)
            case CardRejected():
                self._reject(event.reason, f"instance {event.instance_id}: {event.detail}", self._clock())
            case ChecksumMismatch():
                self._log.checksum_mismatch(event)
            case RuntimeConfigConflict():
                self._log.runtime_config_conflict(event)
            case LegacyDowngrade():
                self._builds.legacy(event)
            case KeyMismatch():
                self.counters["key_mismatch"] += 1
                self._log.key_mismatch(event, total=self.counters["key_mismatch"], now=self._clock())

    # -- instances and declarations -----------------------------------------------------------

    def model_answered(self, name: str) -> None:
        """A worker of ``name`` answered a request (the request plane says so): a newcomer with its
        card gets into a full table in place of a served model whose workers never answered."""
        self.registry.note_answered(name)

    def _on_instance(self, event: InstanceAdded) -> None:
        """A new instance, or a new record of a live one (endpoint, declaration or KV address changed)."""
        live = self.catalog.get(event.model)
        known = live is not None and event.instance.instance_id in live.instances
        self.catalog.set_instance(event.model, event.instance)
        card = self.registry.model_card(event.model)
        if card is not None:
            for listener in self._listeners:
                self._tell(listener.instance_added, card, event.instance)
        self._log.instance_added(event, instances=max(self.registry.instance_count(event.model), 1))
        label = declared_label(event.instance.declared_token)
        if known or label not in self._compositions.get(event.model, ()):
            self._note_composition(event.model)  # one more of a known declaration changes nothing

    def _tell(self, method: Callable[[_T, Instance], None], subject: _T, instance: Instance) -> None:
        """A listener's failure (a bug, or a resource it lacks) is logged and counted: the plane and
        the other listeners go on."""
        try:
            method(subject, instance)
        except Exception as exc:
            self.metrics.listener_failures.inc()
            if self._limiter.allow("listener_failed", time.monotonic()) is not None:
                self._pool_log.error(
                    "instance_listener_failed", instance_id=instance.instance_id, error=repr(exc)[:200]
                )

    def _note_composition(self, model: str) -> None:
        """Log ``pool_composition_changed`` when the set of declarations serving ``model`` changes."""
        live = self.catalog.get(model)
        composition = live.composition() if live is not None else {}
        declarations = tuple(composition)  # sorted
        if declarations == self._compositions.get(model, ()):
            return
        if declarations:
            self._compositions[model] = declarations
        else:
            self._compositions.pop(model, None)
        self._pool_log.info(
            "pool_composition_changed",
            model=model,
            composition=composition,
            mixed=len(declarations) > 1,
        )
