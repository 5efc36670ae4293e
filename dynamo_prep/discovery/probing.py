"""Probing a newcomer the full instance table refused: if its endpoint answers, the registry lets
it in on its next announce (docs/discovery.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from dynamo_prep.discovery.registry import DiscoveryRegistry

__all__ = ["MAX_PROBED", "PROBE_AGAIN_AFTER_S", "PROBE_TIMEOUT_S", "NewcomerProbe", "Prober"]

# A newcomer the full table refused is probed (one at a time; an instance at most once a minute):
# if its endpoint answers within the timeout, the registry lets it in on its next announce.
PROBE_TIMEOUT_S = 1.0
PROBE_AGAIN_AFTER_S = 60.0
MAX_PROBED = 16_384

Prober = Callable[[str, float], Awaitable[bool]]
"""(endpoint, timeout_s) -> whether it answered (the request plane's ``answers``)."""


class NewcomerProbe:
    """Probes one refused newcomer at a time; each instance at most once per ``PROBE_AGAIN_AFTER_S``."""

    def __init__(self, prober: Prober, registry: DiscoveryRegistry, namespace: str) -> None:
        self._prober = prober
        self._registry = registry
        self._log = structlog.get_logger("dynamo_prep.discovery").bind(namespace=namespace)
        self._probing: asyncio.Task[None] | None = None
        self._probed: dict[str, float] = {}  # instance_id -> when, oldest first

    def maybe(self, instance_id: str, endpoint: str, now: float) -> None:
        """Probe ``instance_id`` unless a probe runs or it was probed recently."""
        if self._probing is not None:
            return
        last = self._probed.get(instance_id)
        if last is not None and now - last < PROBE_AGAIN_AFTER_S:
            return
        self._probed.pop(instance_id, None)  # re-inserted: the oldest probe first
        self._probed[instance_id] = now
        if len(self._probed) > MAX_PROBED:
            del self._probed[next(iter(self._probed))]
        self._probing = asyncio.get_running_loop().create_task(self._probe(instance_id, endpoint))

    def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()

    async def _probe(self, instance_id: str, endpoint: str) -> None:
        try:
            answered = await self._prober(endpoint, PROBE_TIMEOUT_S)
        except Exception as exc:  # a probe that cannot run proves nothing; the watcher goes on
            self._log.warning("instance_probe_failed", instance_id=instance_id, error=str(exc)[:200])
            answered = False
        finally:
            self._probing = None
        if answered:
            self._registry.note_proven(instance_id)
            self._log.info("instance_proven", instance_id=instance_id, endpoint=endpoint)
