"""One HTTP request's account: what it asked for, where it went, how it ended; logged and measured once.

The HTTP middleware opens a record per request and closes it when the response is over, so the
``request_finished`` / ``request_failed`` line and the request metrics come from one place and
always agree. Handlers only fill it in (model, routed endpoint, preprocessing, worker outputs,
failure). A streamed response that already sent its 200 can still fail: the record keeps the
real outcome (the error's status, or 499 when the client went away) instead of the 200.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from dynamo_prep.frontend.metrics import UNKNOWN_MODEL, FrontendMetrics, observe_many
from dynamo_prep.logging import DETAIL_CHARS
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Output
from dynamo_prep.routing.policy import Decision

__all__ = ["CLIENT_GONE", "RequestRecord"]

log = structlog.get_logger("dynamo_prep.frontend")

CLIENT_GONE = 499
# Worker verdicts that end a stream as a failure: (status, message), as openai_stream maps them.
_FAILED_FINISH = {
    "deadline": (504, "the request did not finish within the request timeout"),
    "cancelled": (503, "the worker ended the request early (cancelled)"),
}
# Probes and scrapes are not worth a log line each when they succeed.
QUIET_PATHS = frozenset({"/health", "/live", "/metrics"})
COUNTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


@dataclass
class RequestRecord:
    """Filled in while a request is served; ``finish`` logs it and updates the metrics."""

    request_id: str
    path: str
    metrics: FrontendMetrics
    started: float = field(default_factory=time.perf_counter)
    model: str = UNKNOWN_MODEL
    instance_id: str | None = None
    endpoint: str | None = None
    status: int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    images: int | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    tool_calls: int = 0
    reasoning_tokens: int = 0
    kv_overlap_blocks: int | None = None
    prompt_blocks: int | None = None
    _inflight: bool = False
    _last_token_at: float | None = None

    def name_model(self, name: str) -> None:
        """The label for a model the plane knows (live or pending); others stay ``unknown``."""
        self.model = name

    def serving(self, name: str) -> None:
        """The model is live and the request is being served: it counts as in flight."""
        self.model = name
        if not self._inflight:
            self._inflight = True
            self.metrics.of(name).inflight.inc()

    def routed(self, instance: Instance, decision: Decision | None = None) -> None:
        """The instance serving the request now (the last one, after a migration), and what the KV
        router knew when it chose it."""
        self.instance_id = instance.instance_id
        self.endpoint = instance.endpoint
        if decision is not None:
            self.kv_overlap_blocks, self.prompt_blocks = decision.overlap_blocks, decision.prompt_blocks

    def preprocessed(self, request: PreprocessedRequest, seconds: float) -> None:
        self.metrics.of(self.model).preprocess_duration.observe(seconds)
        self.prompt_tokens = len(request.token_ids)
        self.images = len(request.images)

    def output(self, output: Output) -> None:
        """One worker step: first-token time, inter-token gaps, usage, and a failing verdict."""
        now = time.perf_counter()
        count = len(output.token_ids)
        if count and self._last_token_at is None:
            self.ttft_s = now - self.started
            self.metrics.of(self.model).time_to_first_token.observe(self.ttft_s)
        elif count and self._last_token_at is not None:
            gap = (now - self._last_token_at) / count  # an Output may carry several tokens
            observe_many(self.metrics.of(self.model).inter_token_latency, gap, count)
        if count:
            self._last_token_at = now
        self.prompt_tokens = output.prompt_tokens or self.prompt_tokens
        self.completion_tokens = output.completion_tokens
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            if output.finish_reason in _FAILED_FINISH:
                self.fail(*_FAILED_FINISH[output.finish_reason])

    def answered(
        self,
        finish_reason: str | None,
        tool_calls: int,
        reasoning_tokens: int,
        recoveries: Mapping[str, int],
        *,
        family: str = "plain",
    ) -> None:
        """What the client was answered (its finish reason, e.g. ``tool_calls``, replaces the
        worker's), and what the answer parser (``family``) made of the output; recoveries are
        counted by kind."""
        self.finish_reason = finish_reason or self.finish_reason
        self.tool_calls, self.reasoning_tokens = tool_calls, reasoning_tokens
        label = self.metrics.of(self.model).model  # the model's label (``other`` past the cap)
        for kind, count in recoveries.items():
            self.metrics.output_parse_errors.labels(model=label, family=family, kind=kind).inc(count)

    def fail(self, status: int, error: str) -> None:
        """The first failure is the request's outcome (later ones are its consequences)."""
        if self.status is None:
            self.status, self.error = status, error

    def finish(self, response_status: int | None, *, body_complete: bool) -> None:
        """The response is over: decide the outcome, measure it, log it (exactly once)."""
        if self.status is None and not body_complete:
            self.fail(CLIENT_GONE, "client disconnected")
        status = self.status or response_status or 500
        duration_s = time.perf_counter() - self.started
        if self.path in COUNTED_PATHS:
            self._measure(status, duration_s)
        if self.error is None and self.path in QUIET_PATHS and status < 400:
            return
        fields = {
            "request_id": self.request_id,
            "path": self.path,
            "model": self.model,
            "status": status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "duration_ms": round(duration_s * 1000, 1),
            "instance_id": self.instance_id,
            "endpoint": self.endpoint,
            "tool_calls": self.tool_calls,
            "reasoning_tokens": self.reasoning_tokens,
            "kv_overlap_blocks": self.kv_overlap_blocks,
            "prompt_blocks": self.prompt_blocks,
        }
        if self.error is None:
            log.info("request_finished", finish_reason=self.finish_reason, **fields)
        elif status >= 500:
            log.warning("request_failed", error=self.error[:DETAIL_CHARS], **fields)
        else:
            log.info("request_failed", error=self.error[:DETAIL_CHARS], **fields)

    def _measure(self, status: int, duration_s: float) -> None:
        metrics = self.metrics.of(self.model)
        metrics.requests(status).inc()
        if self._inflight:
            self._inflight = False
            metrics.inflight.dec()
            metrics.request_duration.observe(duration_s)
        if self.images is not None:
            metrics.image_parts.observe(self.images)
            metrics.input_tokens.observe(self.prompt_tokens)
        if self.completion_tokens:
            metrics.output_tokens.observe(self.completion_tokens)
