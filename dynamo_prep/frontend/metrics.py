"""The frontend's Prometheus metrics: one ``CollectorRegistry`` per frontend, never the global one.

``FrontendMetrics`` owns the registry and is handed explicitly to each component (the discovery
watcher gets ``.discovery``, the router and the HTTP app get the whole object), so several
frontends can run in one Python process (tests) without sharing counters. Names and labels follow
Dynamo's frontend (``dynamo_frontend_`` prefix) so existing dashboards fit; docs/operations.md
lists each one with what it means.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dynamo_prep.discovery.metrics import PREFIX, DiscoveryMetrics

__all__ = ["CONTENT_TYPE", "UNKNOWN_MODEL", "FrontendMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Requests naming a model nobody announced share one label value: clients cannot grow the label set.
UNKNOWN_MODEL = "unknown"

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_PREPROCESS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_OUTPUT_TOKENS = (1, 8, 32, 128, 512, 2048, 8192, 32768)
_IMAGES = (0, 1, 2, 4, 8, 16, 32, 64)


class FrontendMetrics:
    """Request metrics of the HTTP layer plus the discovery metrics, in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.discovery = DiscoveryMetrics(self.registry)
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}requests",
            "Chat completion requests by model and HTTP status",
            ["model", "status"],
            registry=reg,
        )
        self.inflight = Gauge(f"{PREFIX}inflight_requests", "Requests being served", ["model"], registry=reg)
        self.request_duration = self._histogram("request_duration_seconds", "Request duration", _SECONDS)
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "From request arrival to the first generated token", _SECONDS
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between generated tokens", _ITL_SECONDS
        )
        self.preprocess_duration = self._histogram(
            "preprocess_duration_seconds", "Rendering and tokenizing one request", _PREPROCESS_SECONDS
        )
        self.input_tokens = self._histogram("input_sequence_tokens", "Prompt length in tokens", _TOKENS)
        self.output_tokens = self._histogram(
            "output_sequence_tokens", "Completion length in tokens", _OUTPUT_TOKENS
        )
        self.image_parts = self._histogram("image_parts_per_request", "Image parts per request", _IMAGES)
        self.output_parse_errors = Counter(
            f"{PREFIX}output_parse_errors",
            "Recoveries from malformed model output by the answer parser, by kind (docs/answers.md)",
            ["model", "kind"],
            registry=reg,
        )

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"{PREFIX}{name}", documentation, ["model"], buckets=buckets, registry=self.registry)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (what ``GET /metrics`` returns)."""
        return generate_latest(self.registry)
