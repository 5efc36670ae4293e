"""Prometheus metrics of the frontend's KV-event plane, registered in a registry the caller owns.

Like ``discovery/metrics.py``: nothing touches prometheus_client's global registry, and names carry
Dynamo's ``dynamo_frontend_`` prefix. Labels are bounded sets (event kinds, reasons, outcomes),
never instance ids: per-instance detail is in the log lines, which all carry ``instance_id``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from dynamo_prep.discovery.metrics import PREFIX

__all__ = ["EVENT_KINDS", "REPLAY_OUTCOMES", "KvMetrics"]

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
        # Bound once: the apply path runs per batch.
        self.stored_events = self.events_applied.labels(kind="stored")
        self.removed_events = self.events_applied.labels(kind="removed")
        self.cleared_events = self.events_applied.labels(kind="cleared")
        self.stored_blocks = self.blocks_applied.labels(kind="stored")
        self.removed_blocks = self.blocks_applied.labels(kind="removed")
