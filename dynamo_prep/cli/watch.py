"""``dynamo-prep watch``: a live view of who announced what on the discovery plane.

It subscribes exactly like a frontend and feeds every message through the frontend's own pure
``DiscoveryRegistry`` (dedup by seq, TTL expiry, withdraw tombstones, first-card-wins, checksum
checks), so what it shows is what a frontend on the same plane concludes; it only differs in
what it does with the result: it never fetches files or builds a model, it shows them. Each row is
the registry's own ``Instance`` record, so a mixed pool shows each engine's declared token.

Two outputs: a refreshing table (rich) for people, or ``--json``: one JSON line per change for
scripts (``instance_added``, ``instance_removed``, ``instance_changed``, ``model_added``,
``model_removed``, ``legacy_card``, ``runtime_config_conflict``, ``card_checksum_mismatch``,
``card_rejected``, and a final ``snapshot`` with ``--once-after``).

Reaching the plane: a worker publishes to the address list it was given, so either bind the
watch's SUB (``--bind``) and add that address to the workers' ``--discovery`` list, or run a
broker and connect the watch to its XPUB (``--discovery``), like a frontend behind brokers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import structlog
import zmq
import zmq.asyncio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.registry import (
    CardRejected,
    ChecksumMismatch,
    DiscoveryRegistry,
    InstanceAdded,
    InstanceRemoved,
    LegacyDowngrade,
    ModelFirstSeen,
    ModelRemoved,
    RegistryEvent,
    RuntimeConfigConflict,
)
from dynamo_prep.lifecycle import EXIT_FAILED, EXIT_OK, on_stop_signals
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.discovery import (
    Announce,
    DiscoveryDecodeError,
    Instance,
    declared_label,
    decode_message,
    topic,
)
from dynamo_prep.routing.kv import KvRouting

__all__ = ["Change", "InstanceRow", "PlaneView", "run_watch"]

log = structlog.get_logger("dynamo_prep.watch")

PIPE_WIDTH = 200
KV_STOP_S = 2.0
POLL_MS = 250  # the table's refresh period and the bound on reacting to a stop signal
Change = dict[str, Any]


@dataclass
class InstanceRow:
    """One live instance as the table shows it."""

    model: str
    instance: Instance
    mdcsum: str
    legacy: dict[str, Any] = field(default_factory=dict)
    seq: int = -1
    seen_at: float = 0.0

    def fields(self) -> Change:
        instance = self.instance
        return {
            "model": self.model,
            "instance_id": instance.instance_id,
            "endpoint": instance.endpoint,
            "declared_token": instance.declared_token,
            "declared": declared_label(instance.declared_token),
            "kv_events": instance.kv_events.endpoint if instance.kv_events is not None else None,
            "legacy": self.legacy,
            "mdcsum": self.mdcsum,
            "seq": self.seq,
        }


class KvFollower:
    """The plane's KV events, followed on a thread with its own event loop (the same subscriber and
    index a frontend in kv mode runs), so the table can say how many blocks each instance holds."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._context = zmq.asyncio.Context()
        self._routing = KvRouting(context=self._context)
        self._thread = threading.Thread(target=self._main, name="kv-events", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._routing.subscriber.run())

    def added(self, card: ModelDeploymentCard, instance: Instance) -> None:
        self._loop.call_soon_threadsafe(self._routing.instance_added, card, instance)

    def removed(self, model: str, instance: Instance) -> None:
        self._loop.call_soon_threadsafe(self._routing.instance_removed, model, instance)

    def blocks(self, model: str, instance_id: str) -> int:
        """Blocks the instance's engine holds, as far as its events have said (0 before any)."""
        return self._routing.blocks_held(model).get(instance_id, 0)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._routing.subscriber.close)
        self._thread.join(KV_STOP_S)
        self._context.destroy(linger=0)


@dataclass
class PlaneView:
    """The registry plus a row per live instance; each call returns the changes it caused."""

    namespace: str
    kv: KvFollower | None = None
    registry: DiscoveryRegistry = field(default_factory=DiscoveryRegistry)
    rows: dict[str, InstanceRow] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)
    _legacy: dict[str, dict[str, Any]] = field(default_factory=dict)  # instance_id -> legacy keys
    _limiter: RateLimiter = field(default_factory=RateLimiter)
    _arrival: tuple[int, float] = (-1, 0.0)  # (seq, time) of the announce being applied

    def on_frames(self, frames: Sequence[bytes], now: float) -> list[Change]:
        """One received message: decode, apply to the registry, translate what it concluded."""
        self.counters["messages"] += 1
        if len(frames) != 2:
            return self._rejected("frame_count", f"{len(frames)} frames", now)
        if frames[0] != topic(self.namespace):
            return []
        try:
            message = decode_message(frames[1])
        except DiscoveryDecodeError as exc:
            return self._rejected(exc.reason, exc.detail, now)
        if isinstance(message, Announce):
            self._arrival = (message.seq, now)
        dropped = self._dropped()
        changes = self._translate(self.registry.apply(message, now=now))
        if isinstance(message, Announce) and self._dropped() == dropped:
            self._heartbeat(message, now)
        return changes

    def expire(self, now: float) -> list[Change]:
        return self._translate(self.registry.expire(now))

    def snapshot(self, now: float) -> Change:
        rows = sorted(self.rows.values(), key=lambda row: (row.model, row.instance.instance_id))
        instances = [
            {**row.fields(), "heartbeat_age_s": round(now - row.seen_at, 3), "kv_blocks": self.kv_blocks(row)}
            for row in rows
        ]
        return {"event": "snapshot", "models": self.registry.model_names(), "instances": instances}

    # -- internals ---------------------------------------------------------------------------

    def kv_blocks(self, row: InstanceRow) -> int | None:
        """Blocks the instance holds (None: it publishes no KV events, or they are not followed)."""
        if self.kv is None or row.instance.kv_events is None:
            return None
        return self.kv.blocks(row.model, row.instance.instance_id)

    def _dropped(self) -> int:
        return self.registry.counters["duplicate"] + self.registry.counters["stale"]

    def _rejected(self, reason: str, detail: str, now: float) -> list[Change]:
        self.counters[f"rejected:{reason}"] += 1
        suppressed = self._limiter.allow(reason, now)
        if suppressed is None:
            return []
        return [
            {"event": "card_rejected", "reason": reason, "detail": detail[:300], "suppressed": suppressed}
        ]

    def _heartbeat(self, message: Announce, now: float) -> None:
        """An accepted announce of a live instance: its row's seq and age (its record changes
        only through the registry's ``InstanceAdded``)."""
        row = self.rows.get(message.instance_id)
        if row is not None:
            row.seq, row.seen_at = message.seq, now

    def _translate(self, events: list[RegistryEvent]) -> list[Change]:
        for event in events:  # a legacy card is reported after its instance, whose row shows it too
            if isinstance(event, LegacyDowngrade):
                self._legacy[event.instance_id] = dict(event.legacy)
        return [change for event in events if (change := self._change(event)) is not None]

    def _change(self, event: RegistryEvent) -> Change | None:
        match event:
            case InstanceAdded():
                return self._instance(event)
            case InstanceRemoved():
                instance = event.instance
                self.rows.pop(instance.instance_id, None)
                self._legacy.pop(instance.instance_id, None)
                if self.kv is not None:
                    self.kv.removed(event.model, instance)
                return {
                    "event": "instance_removed",
                    "model": event.model,
                    "instance_id": instance.instance_id,
                    "endpoint": instance.endpoint,
                    "reason": event.reason,
                }
            case ModelFirstSeen():
                return {"event": "model_added", "model": event.model, "mdcsum": event.mdcsum}
            case ModelRemoved():
                return {"event": "model_removed", "model": event.model, "mdcsum": event.mdcsum}
            case LegacyDowngrade():
                return {"event": "legacy_card", **_about(event), "legacy": dict(event.legacy)}
            case RuntimeConfigConflict():
                return {
                    "event": "runtime_config_conflict",
                    **_about(event),
                    "first_instance_id": event.first_instance_id,
                    "fields": _pairs(event.fields),
                }
            case ChecksumMismatch():
                return {
                    "event": "card_checksum_mismatch",
                    **_about(event),
                    "canonical_mdcsum": event.canonical_mdcsum,
                    "mdcsum": event.mdcsum,
                    "differing_fields": _pairs(event.fields),
                }
            case CardRejected():
                self.counters[f"rejected:{event.reason}"] += 1
                detail = event.detail[:300]
                return {
                    "event": "card_rejected",
                    "reason": event.reason,
                    "instance_id": event.instance_id,
                    "detail": detail,
                }
        return None

    def _instance(self, event: InstanceAdded) -> Change:
        """A new row (``instance_added``), or a live row's new record (``instance_changed``)."""
        card = self.registry.model_card(event.model)
        if self.kv is not None and card is not None:
            self.kv.added(card, event.instance)
        row = self.rows.get(event.instance.instance_id)
        if row is not None:
            row.instance, row.model, row.mdcsum = event.instance, event.model, event.mdcsum
            return {"event": "instance_changed", **row.fields()}
        seq, seen_at = self._arrival
        legacy = self._legacy.get(event.instance.instance_id, {})
        row = InstanceRow(event.model, event.instance, event.mdcsum, legacy, seq=seq, seen_at=seen_at)
        self.rows[event.instance.instance_id] = row
        return {"event": "instance_added", **row.fields()}


def _about(event: LegacyDowngrade | RuntimeConfigConflict | ChecksumMismatch) -> Change:
    return {"model": event.model, "instance_id": event.instance_id}


def _pairs(fields: Any) -> dict[str, list[Any]]:
    return {name: [first, later] for name, (first, later) in fields.items()}


# -- rendering -------------------------------------------------------------------------------


def render_table(view: PlaneView, now: float) -> Table:
    """Models and instances, one row per instance, with declaration, legacy flags and liveness."""
    rejected = sum(count for key, count in view.counters.items() if key.startswith("rejected:"))
    table = Table(
        title=f"discovery plane '{view.namespace}': {len(view.registry.model_names())} model(s), "
        f"{len(view.rows)} instance(s), {view.counters['messages']} message(s), {rejected} rejected",
    )
    for column in (
        "model",
        "instance",
        "declared token",
        "kv blocks",
        "legacy",
        "endpoint",
        "heartbeat age",
        "seq",
        "mdcsum",
    ):
        table.add_column(column, overflow="fold")
    for row in sorted(view.rows.values(), key=lambda row: (row.model, row.instance.instance_id)):
        legacy = ", ".join(f"{key}={value}" for key, value in row.legacy.items())
        instance = row.instance
        blocks = view.kv_blocks(row)
        table.add_row(row.model, instance.instance_id[:12], declared_label(instance.declared_token),
                      "-" if blocks is None else str(blocks), legacy or "-", instance.endpoint,
                      f"{now - row.seen_at:.1f}s", str(row.seq), row.mdcsum[:12])  # fmt: skip
    return table


def _json_line(change: Change, stream: TextIO) -> None:
    stamped = {"event": change["event"], "timestamp": datetime.now(UTC).isoformat(), **change}
    stream.write(json.dumps(stamped, default=str) + "\n")
    stream.flush()


# -- the process -----------------------------------------------------------------------------


def run_watch(
    *,
    discovery: Sequence[str] = (),
    bind: Sequence[str] = (),
    namespace: str,
    json_lines: bool = False,
    once_after: float | None = None,
    stream: TextIO | None = None,
) -> int:
    """The ``dynamo-prep watch`` process; returns its exit code (0 on SIGTERM/SIGINT or at the end)."""
    out = stream or sys.stdout
    if not discovery and not bind:
        log.error("watch_config_error", error="give --discovery ADDR (brokers) and/or --bind ADDR")
        return EXIT_FAILED
    context: zmq.Context[Any] = zmq.Context()
    try:
        socket = _subscribe(context, namespace, discovery, bind)
    except zmq.ZMQError as exc:
        log.error("watch_start_failed", error=str(exc), discovery=list(discovery), bind=list(bind))
        context.term()
        return EXIT_FAILED
    log.info(
        "watch_started", discovery=list(discovery), bind=list(bind), namespace=namespace, json=json_lines
    )
    view = PlaneView(namespace, kv=KvFollower())
    try:
        stopping: list[signal.Signals] = []
        with on_stop_signals(stopping.append):
            deadline = None if once_after is None else time.monotonic() + once_after
            done = lambda: bool(stopping) or _past(deadline)  # noqa: E731
            _loop(socket, view, done, json_lines=json_lines, once=once_after is not None, out=out)
    finally:
        socket.close(linger=0)
        context.term()
        if view.kv is not None:
            view.kv.close()
    log.info("watch_stopped", messages=view.counters["messages"])
    return EXIT_OK


def _subscribe(
    context: zmq.Context[Any], namespace: str, discovery: Sequence[str], bind: Sequence[str]
) -> zmq.Socket[Any]:
    socket: zmq.Socket[Any] = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.setsockopt(zmq.SUBSCRIBE, topic(namespace))
        for address in bind:
            socket.bind(address)
        for address in discovery:
            socket.connect(address)
    except zmq.ZMQError:
        socket.close(linger=0)
        raise
    return socket


def _loop(
    socket: zmq.Socket[Any],
    view: PlaneView,
    done: Callable[[], bool],
    *,
    json_lines: bool,
    once: bool,
    out: TextIO,
) -> None:
    """Receive, expire, show; until ``done``. A one-shot table is printed once, at the end."""
    # Piped output (scripts, CI logs) gets a wide table instead of rich's 80-column fallback.
    console = Console(file=out, width=None if out.isatty() else PIPE_WIDTH)
    live = None if json_lines or once else Live(render_table(view, time.monotonic()), console=console)
    with live if live is not None else contextlib.nullcontext():
        while not done():
            changes = _receive(socket, view)
            changes.extend(view.expire(time.monotonic()))
            if json_lines:
                for change in changes:
                    _json_line(change, out)
            elif live is not None:
                live.update(render_table(view, time.monotonic()))
    if json_lines and once:
        _json_line(view.snapshot(time.monotonic()), out)
    elif once:
        console.print(render_table(view, time.monotonic()))


def _receive(socket: zmq.Socket[Any], view: PlaneView) -> list[Change]:
    """Everything that arrived within one poll period."""
    changes: list[Change] = []
    if not socket.poll(POLL_MS, zmq.POLLIN):
        return changes
    while True:
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return changes
        changes.extend(view.on_frames(frames, time.monotonic()))


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
