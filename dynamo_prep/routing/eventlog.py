"""The KV subscriber's log lines, one instance each: every event name and its fields, in one place.

Event names are part of the interface (docs/kv-events.md lists them). Every line a peer can trigger
at message rate (rejections, gaps, replays, resets) goes through a ``RateLimiter`` per instance, so
each (instance, event, reason) logs at most once per second and says how many were suppressed.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from dynamo_prep.logging import DETAIL_CHARS, RateLimiter
from dynamo_prep.protocol.discovery import KvEventsEndpoint

__all__ = ["KvLog"]

_log = structlog.get_logger("dynamo_prep.routing")


class KvLog:
    """Log lines of one followed instance (``instance_id`` bound to each)."""

    __slots__ = ("_instance_id", "_limiter")

    def __init__(self, instance_id: str, *, limiter: RateLimiter | None = None) -> None:
        self._instance_id = instance_id
        self._limiter = limiter or RateLimiter()

    def subscribed(self, kv: KvEventsEndpoint) -> None:
        _log.info(
            "kv_events_subscribed",
            instance_id=self._instance_id,
            endpoint=kv.endpoint,
            replay_endpoint=kv.replay_endpoint,
            topic=kv.topic,
        )

    def unsubscribed(self, reason: str) -> None:
        _log.info("kv_events_unsubscribed", instance_id=self._instance_id, reason=reason)

    def connect_failed(self, address: str, error: str, *, replay: bool) -> None:
        _log.error(
            "kv_events_connect_failed",
            instance_id=self._instance_id,
            address=address,
            error=error[:DETAIL_CHARS],
            replay=replay,
        )

    def reconnected(self, endpoint: str) -> None:
        self._limited("info", "kv_events_reconnected", "", time.monotonic(), endpoint=endpoint)

    def rejected(self, reason: str, detail: str, *, source: str, now: float) -> None:
        self._limited(
            "warning",
            "kv_event_rejected",
            reason,
            now,
            reason=reason,
            source=source,
            detail=detail[:DETAIL_CHARS],
        )

    def gap(self, expected: int, got: int, *, now: float) -> None:
        self._limited("info", "kv_gap_detected", "", now, expected_seq=expected, seq=got)

    def replay_started(self, start_seq: int, reason: str, *, now: float) -> None:
        self._limited("info", "kv_replay_started", reason, now, reason=reason, start_seq=start_seq)

    def replay_finished(
        self, outcome: str, start_seq: int, *, batches: int, last_seq: int | None, seconds: float, now: float
    ) -> None:
        level = "info" if outcome in ("filled", "truncated") else "warning"
        self._limited(
            level,
            "kv_replay_finished",
            outcome,
            now,
            outcome=outcome,
            start_seq=start_seq,
            batches=batches,
            last_seq=last_seq,
            seconds=round(seconds, 3),
        )

    def reset(self, reason: str, *, last_seq: int | None, now: float) -> None:
        self._limited("warning", "kv_instance_reset", reason, now, reason=reason, last_seq=last_seq)

    def sink_failed(self, operation: str, exc: Exception, *, now: float) -> None:
        error = f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS]
        self._limited("error", "kv_sink_failed", operation, now, operation=operation, error=error)

    def serve_failed(self, exc: Exception, *, now: float) -> None:
        error = f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS]
        self._limited("error", "kv_subscriber_failed", type(exc).__name__, now, error=error)

    def _limited(self, level: str, event: str, key: str, now: float, **fields: Any) -> None:
        """At most one ``event`` line per ``key`` (a reason or outcome) per interval."""
        suppressed = self._limiter.allow(f"{event}:{key}", now)
        if suppressed is not None:
            getattr(_log, level)(event, instance_id=self._instance_id, suppressed=suppressed, **fields)
