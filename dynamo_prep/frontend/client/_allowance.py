"""What a worker may send unasked (``Allowance``), and the account of what it was refused (``Refusals``)."""

from __future__ import annotations

import asyncio

import msgspec
import structlog

from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.logging import DETAIL_CHARS, RateLimiter

log = structlog.get_logger("dynamo_prep.frontend")


class Allowance:
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


class Refusals:
    """Counts and logs what was refused of the workers' replies (docs/operations.md, "Worker
    replies"): a metric per reason, and a warning per event at most once a second."""

    def __init__(self, metrics: FrontendMetrics | None) -> None:
        self._metrics = metrics
        self._log = RateLimiter()

    def replies(self, reason: str, count: int) -> None:
        if self._metrics is not None:
            self._metrics.worker_replies_refused.labels(reason=reason).inc(count)

    def undecodable(self, endpoint: str, count: int, error: Exception) -> None:
        """Count a batch's undecodable replies; one line per second at most, naming the first."""
        reason = "too_deep" if isinstance(error, RecursionError) else "undecodable"
        reason = "invalid" if isinstance(error, msgspec.ValidationError) else reason
        self.replies(reason, count)
        suppressed = self._log.allow("reply_rejected", asyncio.get_running_loop().time())
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

    def slow_reader(self, request_id: str, endpoint: str) -> None:
        """A stream cancelled because its client read too slowly."""
        if self._metrics is not None:
            self._metrics.slow_readers.inc()
        self.warn("request_buffer_full", request_id=request_id, endpoint=endpoint)

    def fault(self, reason: str, event: str, **fields: object) -> None:
        if self._metrics is not None:
            self._metrics.worker_faults.labels(reason=reason).inc()
        self.warn(event, key=f"{event}:{reason}", reason=reason, **fields)

    def warn(self, event: str, *, key: str = "", **fields: object) -> None:
        """A warning about a worker's replies, at most once a second per ``key`` (the event's name)."""
        suppressed = self._log.allow(key or event, asyncio.get_running_loop().time())
        if suppressed is not None:
            log.warning(event, suppressed=suppressed, **fields)
