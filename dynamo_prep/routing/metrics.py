"""Prometheus metrics of the frontend's KV-event plane, registered in a registry the caller owns.

Like ``discovery/metrics.py``: nothing touches prometheus_client's global registry, and names carry
Dynamo's ``dynamo_frontend_`` prefix. Labels are bounded sets (event kinds, reasons, outcomes),
never instance ids: per-instance detail is in the log lines, which all carry ``instance_id``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynamo_prep.discovery.metrics import PREFIX
from dynamo_prep.routing.policy import Decision

__all__ = ["EVENT_KINDS", "REPLAY_OUTCOMES", "KvMetrics"]

_DECISION_SECONDS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3)
_OVERLAP_RATIO = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)

EVENT_KINDS = ("stored", "removed", "cleared")
# filled: every batch from the requested seq on; truncated: a first catch-up whose publisher no longer
# buffered the start (nothing was applied before, so nothing is reset); reset: could not fill, the
# instance was reset; timeout: no answer in time, reset; abandoned: the instance restarted or left.
REPLAY_OUTCOMES = ("filled", "truncated", "reset", "timeout", "abandoned")


class KvMetrics:
    """What the KV subscriber did: events and blocks applied, refusals, gaps, replays, resets."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.events_applied = Counter(
            f"{PREFIX}kv_events_applied",
            "KV-cache events handed to the index, by kind (stored, removed, cleared)",
            ["kind"],
            registry=reg,
        )
        self.blocks_applied = Counter(
            f"{PREFIX}kv_blocks_applied",
            "Blocks in the KV-cache events handed to the index, by kind (stored, removed)",
            ["kind"],
            registry=reg,
        )
        self.rejected = Counter(
            f"{PREFIX}kv_events_rejected",
            "Refused KV-event frames, batches and events, by reason",
            ["reason"],
            registry=reg,
        )
        self.duplicates = Counter(
            f"{PREFIX}kv_duplicate_batches",
            "Batches dropped because their seq was already applied (replay and live overlap)",
            registry=reg,
        )
        self.gaps = Counter(f"{PREFIX}kv_gaps", "Sequence gaps seen on an instance's KV events", registry=reg)
        self.replays = Counter(
            f"{PREFIX}kv_replays",
            "Replays asked of an instance's replay endpoint, by outcome",
            ["outcome"],
            registry=reg,
        )
        self.resets = Counter(
            f"{PREFIX}kv_instance_resets",
            "Times an instance's blocks were dropped from the index, by reason",
            ["reason"],
            registry=reg,
        )
        self.instances = Gauge(
            f"{PREFIX}kv_instances_followed", "Instances whose KV events are followed", registry=reg
        )
        self.refused = Counter(
            f"{PREFIX}kv_follow_refused",
            "Instances (or replays) not followed, by reason (socket_limit, endpoint_in_use, foreign_host)",
            ["reason"],
            registry=reg,
        )
        self.blocks_refused = Counter(
            f"{PREFIX}kv_blocks_refused",
            "Blocks of KV-cache events the index refused, by reason (unknown_parent, unknown_block, "
            "over_capacity, invalid)",
            ["reason"],
            registry=reg,
        )
        # Bound once: the apply path runs per batch.
        self.stored_events = self.events_applied.labels(kind="stored")
        self.removed_events = self.events_applied.labels(kind="removed")
        self.cleared_events = self.events_applied.labels(kind="cleared")
        self.stored_blocks = self.blocks_applied.labels(kind="stored")
        self.removed_blocks = self.blocks_applied.labels(kind="removed")
        self.decisions = Counter(
            f"{PREFIX}kv_decisions",
            "KV routing decisions, by reason (overlap: the cheapest instance; balance: no instance held "
            "half the prompt, the least loaded one)",
            ["reason"],
            registry=reg,
        )
        self.decision_seconds = Histogram(
            f"{PREFIX}kv_decision_seconds",
            "Time to hash a request, match it against the index and choose an instance",
            buckets=_DECISION_SECONDS,
            registry=reg,
        )
        self.predicted_blocks = Gauge(
            f"{PREFIX}kv_predicted_blocks",
            "Blocks counted as cached on an instance because a request was routed there, until its "
            "engine's own events speak of them or their time-to-live ends",
            registry=reg,
        )
        self.overlap_ratio = Histogram(
            f"{PREFIX}kv_overlap_ratio",
            "Share of a request's prompt blocks already cached on the chosen instance",
            buckets=_OVERLAP_RATIO,
            registry=reg,
        )

    def index_refused(self, reason: str, blocks: int) -> None:
        """The index refused ``blocks`` blocks of one event (``KvIndex``'s ``on_refused``)."""
        self.blocks_refused.labels(reason=reason).inc(blocks)

    def decided(self, decision: Decision, seconds: float) -> None:
        """One routing decision: its reason, how long it took, how much of the prompt was cached."""
        self.decisions.labels(reason=decision.reason).inc()
        self.decision_seconds.observe(seconds)
        if decision.prompt_blocks:
            self.overlap_ratio.observe(decision.overlap_blocks / decision.prompt_blocks)
