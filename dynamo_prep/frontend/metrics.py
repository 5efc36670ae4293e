"""The frontend's Prometheus metrics: one ``CollectorRegistry`` per frontend, never the global one.

``FrontendMetrics`` owns the registry and is handed explicitly to each component (the discovery
watcher gets ``.discovery``, the router and the HTTP app get the whole object), so several
frontends can run in one Python process (tests) without sharing counters. Names and labels follow
Dynamo's frontend (``dynamo_frontend_`` prefix) so existing dashboards fit; docs/operations.md
lists each one with what it means.

Several HTTP processes (``--http-workers``) share prometheus_client's multiprocess mode: when
``PROMETHEUS_MULTIPROC_DIR`` is set (by their supervisor, ``http_supervisor.py``) every value lives in that
directory's per-process files and ``exposition`` merges them, so any process answers for all.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from dynamo_prep.discovery.metrics import PREFIX, DiscoveryMetrics

__all__ = [
    "CONTENT_TYPE",
    "MAX_MODEL_LABELS",
    "MULTIPROC_ENV",
    "OTHER_MODELS",
    "UNKNOWN_MODEL",
    "FrontendMetrics",
    "ModelMetrics",
    "observe_many",
]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Requests naming a model nobody announced share one label value: clients cannot grow the label set.
UNKNOWN_MODEL = "unknown"
# Served models with their own label set: a flood of announced names (issue 13) would otherwise add
# a few hundred prometheus objects per name asked for, to /metrics and to every full collection.
# Beyond this many, further models share OTHER_MODELS.
MAX_MODEL_LABELS = 1024
OTHER_MODELS = "other"

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
            "Chat completion and Responses API requests by model and HTTP status",
            ["model", "status"],
            registry=reg,
        )
        self.loop_stalls = Counter(
            f"{PREFIX}event_loop_stalls",
            "Times the frontend's event loop ran a timer over 100 ms late, by cause: host (it waited"
            " for a CPU), loop (its own code ran), stopped, unknown",
            ["cause"],
            registry=reg,
        )
        self.request_plane_refused = Counter(
            f"{PREFIX}request_plane_refused",
            "Requests not sent to a worker: the frontend had no socket left for a channel to it",
            registry=reg,
        )
        self.worker_replies_refused = Counter(
            f"{PREFIX}worker_replies_refused",
            "Worker replies refused or corrected, by reason (docs/operations.md)",
            ["reason"],
            registry=reg,
        )
        self.worker_faults = Counter(
            f"{PREFIX}worker_faults",
            "Workers given up on: a channel dropped (flooding, garbage) or a request moved "
            "(no_first_token, stalled_stream)",
            ["reason"],
            registry=reg,
        )
        self.slow_readers = Counter(
            f"{PREFIX}slow_readers",
            "Streams cancelled because their client read slower than the worker wrote (buffer full)",
            registry=reg,
        )
        self.inflight = Gauge(
            f"{PREFIX}inflight_requests",
            "Requests being served",
            ["model"],
            registry=reg,
            multiprocess_mode="livesum",
        )
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
            "Recoveries from malformed model output by the answer parser, by parser family and kind "
            "(docs/answers.md)",
            ["model", "family", "kind"],
            registry=reg,
        )
        self.http_refused = Counter(
            f"{PREFIX}http_refused",
            "Connections and requests the HTTP server refused at its limits, by reason (docs/operations.md)",
            ["reason"],
            registry=reg,
        )
        self.http_idle_closed = Counter(
            f"{PREFIX}http_idle_closed",
            "Idle connections closed to make room for a newcomer, by the limit reached",
            ["reason"],
            registry=reg,
        )
        self.schema_checks_in_flight = Gauge(
            f"{PREFIX}schema_checks_in_flight",
            "JSON Schema metaschema checks admitted, waiting for a checker process or running",
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.schema_checks = Counter(
            f"{PREFIX}schema_checks",
            "JSON Schema metaschema checks by outcome (valid, invalid, cached, cancelled, timeout, busy, "
            "failed)",
            ["outcome"],
            registry=reg,
        )
        self._models: dict[str, ModelMetrics] = {}

    def of(self, model: str) -> ModelMetrics:
        """The per-model series of ``model``, looked up once (``labels`` costs a lock and a dict
        per call; the label set is the served models, at most ``MAX_MODEL_LABELS``, plus ``unknown``
        and ``other``)."""
        found = self._models.get(model)
        if found is None:
            crowded = len(self._models) >= MAX_MODEL_LABELS and model != UNKNOWN_MODEL
            label = OTHER_MODELS if crowded else model
            found = self._models.get(label)
            if found is None:
                found = self._models[label] = ModelMetrics(self, label)
        return found

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"{PREFIX}{name}", documentation, ["model"], buckets=buckets, registry=self.registry)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (what ``GET /metrics`` returns); in multiprocess
        mode, every process's values merged."""
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=directory)  # type: ignore[no-untyped-call]
        merged.register(self.discovery.instances)  # this process's view: every child follows the plane
        return generate_latest(merged)


class ModelMetrics:
    """One model's children of the request metrics (``FrontendMetrics.of``)."""

    def __init__(self, metrics: FrontendMetrics, model: str) -> None:
        self._requests = metrics.requests
        self._by_status: dict[int, Counter] = {}
        self.model = model
        self.inflight = metrics.inflight.labels(model=model)
        self.request_duration = metrics.request_duration.labels(model=model)
        self.time_to_first_token = metrics.time_to_first_token.labels(model=model)
        self.inter_token_latency = metrics.inter_token_latency.labels(model=model)
        self.preprocess_duration = metrics.preprocess_duration.labels(model=model)
        self.input_tokens = metrics.input_tokens.labels(model=model)
        self.output_tokens = metrics.output_tokens.labels(model=model)
        self.image_parts = metrics.image_parts.labels(model=model)

    def requests(self, status: int) -> Counter:
        found = self._by_status.get(status)
        if found is None:
            found = self._by_status[status] = self._requests.labels(model=self.model, status=str(status))
        return found


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``count`` observations of ``value`` (the tokens of one worker step share its gap), at the
    cost of one: prometheus_client's ``observe`` takes a lock per call and has no weight, so this
    adds to its sum and to the one bucket directly, exactly as ``count`` calls would."""
    bounds = getattr(histogram, "_upper_bounds", None)
    if count == 1 or bounds is None:  # one observation, or a prometheus_client that changed
        for _ in range(count):
            histogram.observe(value)
        return
    histogram._sum.inc(value * count)
    for index, bound in enumerate(bounds):
        if value <= bound:
            histogram._buckets[index].inc(count)
            return
