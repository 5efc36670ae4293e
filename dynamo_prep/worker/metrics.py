"""A worker's own Prometheus metrics (``dynamo_worker_*``) and the small HTTP server exposing them.

Counted where the worker's messages pass, not inside the generation code: every message a
Generate handler sends goes through a counting ``reply``, so requests are counted by their final
message (``stop``, ``length``, ``cancelled``, ``deadline`` or ``error_<code>``: the same words as
the worker's ``request_finished`` line), tokens by what was actually streamed, prompt tokens and
prefix-cache hits by the final ``Output`` of each request that ran. Contract violations are
counted around the engine's contract check. Gauges read their owner's own count at scrape time
(in flight, blocks held, the engine's unfinished requests). The registry is the worker's own
(never prometheus_client's global one); the server is prometheus_client's, in a daemon thread.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics_core import Metric

from dynamo_prep.engines.base import CheckFn, EngineContractError
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import ErrorReply, Generate, Output
from dynamo_prep.worker.generate import Reply

__all__ = ["PREFIX", "MetricsServer", "WorkerMetrics"]

log = structlog.get_logger("dynamo_prep.worker")

PREFIX = "dynamo_worker_"
DEFAULT_METRICS_HOST = "0.0.0.0"
GenerateHandler = Callable[[Generate, Reply], Awaitable[None]]


class WorkerMetrics:
    """Requests by outcome, requests in flight, streamed and prompt tokens, engine contract
    violations, prefix-cache hits and blocks held."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}requests",
            "Generate requests by final message (finish reason or error_<code>)",
            ["status"],
            registry=reg,
        )
        self.inflight = Gauge(f"{PREFIX}inflight_requests", "Generations running now", registry=reg)
        self.generated_tokens = Counter(
            f"{PREFIX}generated_tokens", "Tokens streamed to frontends", registry=reg
        )
        self.contract_violations = Counter(
            f"{PREFIX}contract_violations",
            "Requests refused because their prompt broke the engine's image contract",
            ["flavor"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens of the requests that ran (final outputs)", registry=reg
        )
        self.kv_cached_tokens = Counter(
            f"{PREFIX}kv_cached_tokens",
            "Prompt tokens whose KV the prefix cache already held (not prefilled again)",
            registry=reg,
        )
        self.kv_blocks = Gauge(f"{PREFIX}kv_blocks", "Blocks held by the prefix cache", registry=reg)
        self.engine_unfinished = Gauge(
            f"{PREFIX}engine_unfinished_requests",
            "Requests the engine itself has not finished (its own count)",
            registry=reg,
        )

    def track_kv_blocks(self, blocks: Callable[[], int]) -> None:
        """The gauge reads the prefix cache's own count at scrape time."""
        self.kv_blocks.set_function(lambda: float(blocks()))

    def track_engine_unfinished(self, unfinished: Callable[[], int]) -> None:
        """The gauge reads the engine's own count of unfinished requests at scrape time."""
        self.engine_unfinished.set_function(lambda: float(unfinished()))

    def include_engine_metrics(self) -> None:
        """Serve the engine's own metrics too (vLLM's ``vllm:*`` live in prometheus_client's global
        registry, in this process): one port shows the worker and its engine."""
        self.registry.register(_GlobalRegistry())

    def track_inflight(self, in_flight: Callable[[], int]) -> None:
        """The gauge reads the generation server's own count at scrape time (never drifts)."""
        self.inflight.set_function(lambda: float(in_flight()))

    def counting_generate(self, handler: GenerateHandler) -> GenerateHandler:
        """``handler`` with a ``reply`` that counts every message it sends."""

        async def on_generate(message: Generate, reply: Reply) -> None:
            await handler(message, self._counting(reply))

        return on_generate

    def counting_check(self, check: CheckFn, flavor: str) -> CheckFn:
        """``check`` that counts each ``EngineContractError`` it raises under ``flavor``."""

        def checked(request: PreprocessedRequest) -> None:
            try:
                check(request)
            except EngineContractError:
                self.contract_violations.labels(flavor=flavor).inc()
                raise

        return checked

    def _counting(self, reply: Reply) -> Reply:
        async def counted(message: wire.FromWorker) -> None:
            if isinstance(message, Output):
                self.generated_tokens.inc(len(message.token_ids))
                if message.finish_reason is not None:
                    self.requests.labels(status=message.finish_reason).inc()
                    self.prompt_tokens.inc(message.prompt_tokens)
                    self.kv_cached_tokens.inc(message.cached_tokens)
            elif isinstance(message, ErrorReply):
                self.requests.labels(status=f"error_{message.code}").inc()
            await reply(message)

        return counted


class _GlobalRegistry:
    """prometheus_client's process-wide registry, as one collector of the worker's own."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()


class MetricsServer:
    """prometheus_client's HTTP server for one registry; ``port`` 0 binds a free port."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = DEFAULT_METRICS_HOST) -> None:
        server, thread = start_http_server(port, addr=host, registry=registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port: int = server.server_port
        log.info("worker_metrics_started", host=host, port=self.port, path="/metrics")

    def close(self) -> None:
        """Stop serving (waits for the server thread's poll loop, half a second at most)."""
        self._server.shutdown()
        self._server.server_close()
