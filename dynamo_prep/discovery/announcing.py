"""How a worker announces itself on the discovery plane, as one value passed whole.

Light on purpose (no ZeroMQ): the worker's config builds it; ``CardPublisher`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_prep.protocol.discovery import DEFAULT_HEARTBEAT_S, DEFAULT_NAMESPACE, DEFAULT_TTL_MS

if TYPE_CHECKING:  # ZeroMQ only when keyed
    from dynamo_prep.discovery.trust import ClientCurve

__all__ = ["Announcing"]


@dataclass(frozen=True, slots=True)
class Announcing:
    """Where (``discovery``: frontends' or brokers' addresses) and how a worker announces its card:
    its ``namespace``, every ``heartbeat_s``, to be kept ``ttl_ms`` without news, with the
    pre-declaration ``legacy_runtime`` keys (to exercise rolling upgrades) and its CURVE key."""

    discovery: tuple[str, ...]
    namespace: str = DEFAULT_NAMESPACE
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    ttl_ms: int = DEFAULT_TTL_MS
    legacy_runtime: Mapping[str, Any] | None = None
    curve: ClientCurve | None = None
