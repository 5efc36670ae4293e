"""The frontend's options, validated once: what every ``dynamo-prep frontend`` flag means.

Light on purpose (no HTTP stack, no ZeroMQ, no formatter): the CLI reads its defaults here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_prep.protocol.discovery import DEFAULT_BIND, DEFAULT_NAMESPACE
from dynamo_prep.protocol.schema_bounds import SchemaLimits
from dynamo_prep.routing.settings import (
    DEFAULT_KV_OVERLAP_SCORE_WEIGHT,
    DEFAULT_KV_PREDICT_TTL_S,
    DEFAULT_ROUTER_MODE,
    DEFAULT_ROUTER_TEMPERATURE,
    ROUTER_MODES,
    RouterMode,
    RouterSettings,
)

if TYPE_CHECKING:  # loaded on demand: reading the defaults must not import ZeroMQ
    from dynamo_prep.discovery.trust import ServerCurve

__all__ = [
    "BUSY_STEP_WINDOW_S",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_FIRST_TOKEN_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_HTTP_HOST",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_HTTP_WORKERS",
    "DEFAULT_KV_OVERLAP_SCORE_WEIGHT",
    "DEFAULT_KV_PREDICT_TTL_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CLIENT_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_QUEUED_REQUESTS",
    "DEFAULT_MAX_URL_BYTES",
    "DEFAULT_QUEUE_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_ROUTER_MODE",
    "DEFAULT_ROUTER_TEMPERATURE",
    "DEFAULT_STREAM_STALL_TIMEOUT_S",
    "DEFAULT_WORKER_STALL_TIMEOUT_S",
    "RETRY_AFTER_S",
    "ROUTER_MODES",
    "FrontendConfig",
    "HttpSettings",
    "PoolSettings",
    "RouterMode",
    "RouterSettings",
]

DEFAULT_HTTP_HOST = "0.0.0.0"
DEFAULT_HTTP_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_REQUEST_TIMEOUT_S = 300.0
# A request whose worker streamed no token this long after it was sent moves to another instance
# (docs/operations.md, "Worker replies"): above the longest prefill of a long prompt on a busy engine.
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 120.0
# A stream that had its first token and then none for this long moves like one without a first
# token (docs/request-plane.md, "Busy, hung and dead"): above any real engine's pause between two
# tokens, and above the workers' own --engine-stall-timeout (30 s), who know first.
DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0
# A worker with requests in flight that says nothing at all (no reply, not even a pong) for this
# long is lost; an expired instance keeps its streams while it spoke within a quarter of it.
DEFAULT_WORKER_STALL_TIMEOUT_S = 10.0
# When every instance of a model is saturated (its card's max_num_seqs requests running), requests
# wait at the frontend, at most this many per model and this long each; then 503 with Retry-After.
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_QUEUE_TIMEOUT_S = 30.0
RETRY_AFTER_S = 2
# An instance whose heartbeat says requests wait is busy, not dead (a request there keeps its place
# past the first-token and stall deadlines), while its engine made a step within this long.
BUSY_STEP_WINDOW_S = 5.0
# A client gets this long for a request's headers, and again for its body; slower ones get 408.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
# Open connections per HTTP process (well below the fd limit); at the cap a newcomer closes the
# longest idle connection, else gets 503 at once (docs/operations.md, "HTTP limits").
DEFAULT_MAX_CONNECTIONS = 4096
# Open connections per client address: one client cannot take every slot (raise it behind a proxy).
DEFAULT_MAX_CLIENT_CONNECTIONS = 512
# A request's head: longer URLs get 414, more header bytes (request line included) or headers 431.
DEFAULT_MAX_URL_BYTES = 8 << 10
DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_MAX_HEADERS = 100
DEFAULT_HTTP_WORKERS = 1


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """What the HTTP flags mean (``--max-body-bytes``, ``--request-timeout``, ``--first-token-timeout``,
    ``--http-header-timeout``,
    ``--http-body-timeout``, ``--http-max-connections``, ``--http-max-client-connections``,
    ``--http-max-url-bytes``, ``--http-max-header-bytes``, ``--http-max-headers``, ``--schema-limit``)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS
    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    schema_limits: SchemaLimits = field(default_factory=SchemaLimits)


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """What the flags about the worker pool mean (``--stream-stall-timeout``,
    ``--worker-stall-timeout``, ``--max-queued-requests``, ``--queue-timeout``)."""

    stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S
    worker_stall_timeout_s: float = DEFAULT_WORKER_STALL_TIMEOUT_S
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not (
            self.stream_stall_timeout_s > 0 and self.worker_stall_timeout_s > 0 and self.queue_timeout_s > 0
        ):
            raise ValueError(
                "--stream-stall-timeout, --worker-stall-timeout and --queue-timeout must be positive"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Validated frontend options (what the CLI flags mean, checked once)."""

    bind: tuple[str, ...] = ()
    connect: tuple[str, ...] = ()
    namespace: str = DEFAULT_NAMESPACE
    model_path: Path | None = None
    cache_dir: Path | None = None
    curve: ServerCurve | None = None
    http_host: str = DEFAULT_HTTP_HOST
    http_port: int = DEFAULT_HTTP_PORT
    http_workers: int = DEFAULT_HTTP_WORKERS
    http: HttpSettings = field(default_factory=HttpSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)

    @classmethod
    def from_options(
        cls,
        *,
        discovery_bind: str | None = None,
        discovery: Sequence[str] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        model_path: str | Path | None = None,
        cache_dir: Path | None = None,
        curve_secret_key: Path | None = None,
        curve_allow_dir: Path | None = None,
        http_host: str = DEFAULT_HTTP_HOST,
        http_port: int = DEFAULT_HTTP_PORT,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        first_token_timeout_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
        http_workers: int = DEFAULT_HTTP_WORKERS,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS,
        max_url_bytes: int = DEFAULT_MAX_URL_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        schema_limits: Sequence[str] = (),
        router_mode: RouterMode = DEFAULT_ROUTER_MODE,
        kv_overlap_score_weight: float = DEFAULT_KV_OVERLAP_SCORE_WEIGHT,
        router_temperature: float = DEFAULT_ROUTER_TEMPERATURE,
        kv_predict_ttl_s: float = DEFAULT_KV_PREDICT_TTL_S,
        kv_endpoint_hosts: Sequence[str] = (),
        stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
        worker_stall_timeout_s: float = DEFAULT_WORKER_STALL_TIMEOUT_S,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
    ) -> FrontendConfig:
        """Embedded plane on ``DEFAULT_BIND`` unless told otherwise; CURVE needs both key options.

        Several HTTP processes (``http_workers``) share the embedded plane through a forwarder in
        their parent (``http_supervisor.py``); CURVE is refused with them: the per-instance key binding
        lives in a frontend's own bound socket (run brokers with keys and ``--discovery`` instead).
        """
        if discovery_bind and discovery:
            raise ValueError("give --discovery-bind (embedded plane) or --discovery (brokers), not both")
        if (curve_secret_key is None) != (curve_allow_dir is None):
            raise ValueError("--curve-secret-key and --curve-allow-dir go together")
        connect = tuple(discovery or ())
        bind = (discovery_bind,) if discovery_bind else (() if connect else (DEFAULT_BIND,))
        curve = None
        if curve_secret_key is not None and curve_allow_dir is not None:
            if connect:
                raise ValueError(
                    "frontend CURVE secures its bound plane; with brokers, give the keys to the brokers"
                )
            from dynamo_prep.discovery.trust import ServerCurve  # noqa: PLC0415 - ZeroMQ only when keyed

            curve = ServerCurve.load(curve_secret_key, curve_allow_dir)
        if not 0 <= http_port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535, got {http_port}")
        if max_body_bytes < 1 or request_timeout_s <= 0 or not first_token_timeout_s > 0:
            raise ValueError("--max-body-bytes, --request-timeout and --first-token-timeout must be positive")
        if not (header_timeout_s > 0 and body_timeout_s > 0 and max_connections >= 1):
            raise ValueError(
                "--http-header-timeout, --http-body-timeout, --http-max-connections must be positive"
            )
        if min(max_client_connections, max_url_bytes, max_header_bytes, max_headers) < 1:
            raise ValueError(
                "--http-max-client-connections, --http-max-url-bytes, --http-max-header-bytes, "
                "--http-max-headers must be positive"
            )
        limits = SchemaLimits.with_overrides(list(schema_limits))
        if http_workers < 1:
            raise ValueError(f"--http-workers must be at least 1, got {http_workers}")
        if http_workers > 1 and curve is not None:
            raise ValueError(
                "--http-workers > 1 cannot keep CURVE's per-instance key binding on the embedded plane: "
                "run a broker with the keys and give the frontends --discovery"
            )
        return cls(
            bind=bind,
            connect=connect,
            namespace=namespace,
            model_path=Path(model_path) if model_path is not None else None,
            cache_dir=cache_dir,
            curve=curve,
            http_host=http_host,
            http_port=http_port,
            http_workers=http_workers,
            http=HttpSettings(
                max_body_bytes=max_body_bytes,
                request_timeout_s=request_timeout_s,
                first_token_timeout_s=first_token_timeout_s,
                header_timeout_s=header_timeout_s,
                body_timeout_s=body_timeout_s,
                max_connections=max_connections,
                max_client_connections=max_client_connections,
                max_url_bytes=max_url_bytes,
                max_header_bytes=max_header_bytes,
                max_headers=max_headers,
                schema_limits=limits,
            ),
            router=RouterSettings(
                mode=router_mode,
                kv_overlap_score_weight=kv_overlap_score_weight,
                temperature=router_temperature,
                predict_ttl_s=kv_predict_ttl_s,
                kv_endpoint_hosts=tuple(kv_endpoint_hosts),
            ),
            pool=PoolSettings(
                stream_stall_timeout_s=stream_stall_timeout_s,
                worker_stall_timeout_s=worker_stall_timeout_s,
                max_queued_requests=max_queued_requests,
                queue_timeout_s=queue_timeout_s,
            ),
        )
