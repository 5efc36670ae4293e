"""The frontend's discovery log lines: every event name and its fields, in one place.

The event names are part of the interface (ops alert on them; docs/discovery.md lists them), so
they live here rather than scattered through the watcher. Lines a peer can trigger at message rate
(``card_rejected``, ``curve_key_mismatch``) are rate-limited per reason and say how many were
suppressed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from dynamo_prep.discovery.builder import BuiltModel, ModelBuildError
from dynamo_prep.discovery.registry import (
    ChecksumMismatch,
    InstanceAdded,
    InstanceRemoved,
    KeyMismatch,
    LegacyDowngrade,
    ModelRemoved,
    RuntimeConfigConflict,
)
from dynamo_prep.logging import DETAIL_CHARS, RateLimiter
from dynamo_prep.protocol.discovery import OPEN_PLANE_HINT, declared_label, reachable_from_elsewhere

__all__ = ["DiscoveryLog"]

DRAIN_HINT = (
    "drain all old workers of this model before deploying a new version, or serve it under a new name"
)
LEGACY_HINT = "upgrade this worker so it declares runtime_config.image_placeholder_token"
FIRST_WINS = "first card wins: this model keeps the first value"
PER_INSTANCE_TOKEN = "each request is rendered with the token of the instance it is routed to"


class DiscoveryLog:
    """Structured log lines of the frontend's discovery plane, bound to one namespace.

    A fresh logger is bound per instance (not a module-level one), so the context is per watcher.
    """

    def __init__(self, namespace: str, *, limiter: RateLimiter | None = None) -> None:
        self._log = structlog.get_logger("dynamo_prep.discovery").bind(namespace=namespace)
        self._limiter = limiter or RateLimiter()

    def plane_open(self, addresses: Sequence[str], *, bound: bool) -> None:
        """No CURVE: loud (error) when a bound address is reachable from other hosts."""
        exposed = [address for address in addresses if bound and reachable_from_elsewhere(address)]
        level = self._log.error if exposed else self._log.info
        level("discovery_plane_open", addresses=list(addresses), exposed=exposed, hint=OPEN_PLANE_HINT)

    def card_rejected(self, reason: str, detail: str, *, total: int, now: float) -> None:
        suppressed = self._limiter.allow(f"card_rejected:{reason}", now)
        if suppressed is not None:
            self._log.warning(
                "card_rejected",
                reason=reason,
                detail=detail[:DETAIL_CHARS],
                suppressed=suppressed,
                total=total,
            )

    def key_mismatch(self, event: KeyMismatch, *, total: int, now: float) -> None:
        suppressed = self._limiter.allow("curve_key_mismatch", now)
        if suppressed is not None:
            self._log.warning(
                "curve_key_mismatch",
                instance_id=event.instance_id,
                action=event.action,
                bound_key=event.bound_key,
                offered_key=event.offered_key,
                suppressed=suppressed,
                total=total,
            )

    def instance_added(self, event: InstanceAdded, *, instances: int) -> None:
        instance = event.instance
        self._log.info(
            "instance_added",
            model=event.model,
            instance_id=instance.instance_id,
            endpoint=instance.endpoint,
            declared_token=instance.declared_token,
            kv_events=instance.kv_events.endpoint if instance.kv_events is not None else None,
            mdcsum=event.mdcsum,
            instances=instances,
        )

    def instance_removed(self, event: InstanceRemoved) -> None:
        self._log.info(
            "instance_removed",
            model=event.model,
            instance_id=event.instance.instance_id,
            endpoint=event.instance.endpoint,
            reason=event.reason,
        )

    def model_removed(self, event: ModelRemoved) -> None:
        self._log.info("model_removed", model=event.model, mdcsum=event.mdcsum)

    def checksum_mismatch(self, event: ChecksumMismatch) -> None:
        self._log.error(
            "card_checksum_mismatch",
            model=event.model,
            instance_id=event.instance_id,
            canonical_mdcsum=event.canonical_mdcsum,
            mdcsum=event.mdcsum,
            differing_fields=_pairs(event.fields, "canonical", "offered"),
            hint=DRAIN_HINT,
        )

    def runtime_config_conflict(self, event: RuntimeConfigConflict) -> None:
        """One line per differing field, so ops can grep for ``field=image_placeholder_token``."""
        for name, (first, later) in event.fields.items():
            self._log.warning(
                "runtime_config_conflict",
                model=event.model,
                instance_id=event.instance_id,
                first_instance_id=event.first_instance_id,
                field=name,
                first_value=first,
                later_value=later,
                effect=PER_INSTANCE_TOKEN if name == "image_placeholder_token" else FIRST_WINS,
            )

    def legacy_downgrade(self, event: LegacyDowngrade, built: BuiltModel | None) -> None:
        """One line per legacy key: what the old worker meant, and what is rendered instead."""
        rendered = built.checkpoint_token() if built is not None else None
        for key, value in event.legacy.items():
            self._log.warning(
                "legacy_card_silent_downgrade",
                model=event.model,
                instance_id=event.instance_id,
                legacy_key=key,
                legacy_value=value,
                rendered_instead=declared_label(rendered),
                hint=LEGACY_HINT,
            )

    def model_added(
        self, name: str, mdcsum: str, instance_id: str, built: BuiltModel, *, instances: int, build_ms: float
    ) -> None:
        self._log.info(
            "model_added",
            model=name,
            mdcsum=mdcsum,
            instance_id=instance_id,
            declared_token=built.declared_token,
            rendered_token=built.rendered_token,
            formatter=built.formatter_kind,
            model_dir=str(built.model_dir),
            instances=instances,
            build_ms=round(build_ms, 1),
        )

    def model_build_failed(
        self,
        name: str,
        mdcsum: str,
        instance_id: str,
        endpoint: str,
        exc: Exception,
        *,
        attempt: int,
        retry_in_s: float,
    ) -> None:
        cause = exc.cause if isinstance(exc, ModelBuildError) else exc
        self._log.error(
            "model_build_failed",
            model=name,
            mdcsum=mdcsum,
            instance_id=instance_id,
            endpoint=endpoint,
            reason=exc.stage if isinstance(exc, ModelBuildError) else "unexpected",
            error=f"{type(cause).__name__}: {cause}"[:DETAIL_CHARS],
            attempt=attempt,
            retry_in_s=retry_in_s,
        )

    def model_build_discarded(self, name: str, mdcsum: str) -> None:
        self._log.info("model_build_discarded", model=name, mdcsum=mdcsum, reason="no live instance left")


def _pairs(fields: Mapping[str, tuple[Any, Any]], first: str, second: str) -> dict[str, dict[str, Any]]:
    return {name: {first: a, second: b} for name, (a, b) in fields.items()}
