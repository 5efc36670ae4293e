"""Every ``dynamo-prep frontend`` flag, declared once: the CLI builds its parser from this table and
passes ``FRONTEND_OPTIONS.values(args)`` to ``FrontendConfig.from_options``, which validates them.

Light on purpose (the CLI reads it to build its parser): defaults come from ``frontend.config``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from dynamo_prep.frontend import config as d
from dynamo_prep.options import CURVE_ALLOW_DIR, NAMESPACE, Option, Options, addresses
from dynamo_prep.protocol.discovery import DEFAULT_BIND

__all__ = ["FRONTEND_OPTIONS"]

_PLANE: Final = (
    Option(
        "--discovery-bind",
        f"bind the embedded plane here (default {DEFAULT_BIND})",
        key="discovery_bind",
        exclusive="plane",
    ),
    Option(
        "--discovery",
        "connect to brokers' XPUB ADDR[,ADDR] instead",
        key="discovery",
        exclusive="plane",
        spec={"type": addresses},
    ),
    NAMESPACE,
    Option("--model-path", "local model directory used when its checksums match", key="model_path"),
    Option(
        "--cache-dir",
        "content-addressed cache of model files fetched from workers (env DYN_PREP_CACHE_DIR)",
        key="cache_dir",
        spec={"type": Path},
    ),
    Option(
        "--curve-secret-key",
        "this frontend's CURVE secret key file (embedded plane)",
        key="curve_secret_key",
        spec={"type": Path},
    ),
    CURVE_ALLOW_DIR,
)

# The HTTP flags, each mirrored by a ``DYN_*`` environment variable (the flag wins).
_HTTP: Final = tuple(
    Option(flag, text, key=key, default=default, env=env, spec={"type": kind})
    for flag, key, env, kind, default, text in (
        ("--http-host", "http_host", "DYN_HTTP_HOST", str, d.DEFAULT_HTTP_HOST, "address to serve HTTP on"),
        ("--http-port", "http_port", "DYN_HTTP_PORT", int, d.DEFAULT_HTTP_PORT, "0: any free port"),
        ("--max-body-bytes", "max_body_bytes", "DYN_MAX_BODY_BYTES", int, d.DEFAULT_MAX_BODY_BYTES,
         "larger bodies get 413"),
        ("--request-timeout", "request_timeout_s", "DYN_REQUEST_TIMEOUT", float, d.DEFAULT_REQUEST_TIMEOUT_S,
         "per-request deadline in seconds, queueing included"),
        ("--first-token-timeout", "first_token_timeout_s", "DYN_FIRST_TOKEN_TIMEOUT", float,
         d.DEFAULT_FIRST_TOKEN_TIMEOUT_S,
         "seconds for a worker's first token; then the request moves to another instance"),
        ("--http-workers", "http_workers", "DYN_HTTP_WORKERS", int, d.DEFAULT_HTTP_WORKERS,
         "frontend processes serving the one HTTP port (SO_REUSEPORT), each a whole frontend"),
        ("--http-header-timeout", "header_timeout_s", "DYN_HTTP_HEADER_TIMEOUT", float,
         d.DEFAULT_HEADER_TIMEOUT_S,
         "seconds for a request's headers to arrive, else 408"),
        ("--http-body-timeout", "body_timeout_s", "DYN_HTTP_BODY_TIMEOUT", float,
         d.DEFAULT_BODY_TIMEOUT_S,
         "seconds for a request's body to arrive, else 408"),
        ("--http-max-connections", "max_connections", "DYN_HTTP_MAX_CONNECTIONS", int,
         d.DEFAULT_MAX_CONNECTIONS,
         "open connections per HTTP process; at it the longest idle one is closed, else 503"),
        ("--http-max-client-connections", "max_client_connections", "DYN_HTTP_MAX_CLIENT_CONNECTIONS", int,
         d.DEFAULT_MAX_CLIENT_CONNECTIONS, "open connections per client address (raise it behind a proxy)"),
        ("--http-max-url-bytes", "max_url_bytes", "DYN_HTTP_MAX_URL_BYTES", int, d.DEFAULT_MAX_URL_BYTES,
         "longer request URLs get 414"),
        ("--http-max-header-bytes", "max_header_bytes", "DYN_HTTP_MAX_HEADER_BYTES", int,
         d.DEFAULT_MAX_HEADER_BYTES, "larger request heads (request line and headers) get 431"),
        ("--http-max-headers", "max_headers", "DYN_HTTP_MAX_HEADERS", int, d.DEFAULT_MAX_HEADERS,
         "requests with more headers get 431"),
        ("--stream-stall-timeout", "stream_stall_timeout_s", "DYN_STREAM_STALL_TIMEOUT", float,
         d.DEFAULT_STREAM_STALL_TIMEOUT_S,
         "seconds without a token once a stream started; then it moves like one without a first token"),
        ("--worker-stall-timeout", "worker_stall_timeout_s", "DYN_WORKER_STALL_TIMEOUT", float,
         d.DEFAULT_WORKER_STALL_TIMEOUT_S,
         "seconds a worker with requests in flight may say nothing (not even a pong) before they move; "
         "an expired instance's streams stay while it spoke within a quarter of it"),
        ("--max-queued-requests", "max_queued_requests", "DYN_MAX_QUEUED_REQUESTS", int,
         d.DEFAULT_MAX_QUEUED_REQUESTS,
         "requests per model waiting for room while every instance is saturated; more get 503 with "
         "Retry-After"),
        ("--queue-timeout", "queue_timeout_s", "DYN_QUEUE_TIMEOUT", float, d.DEFAULT_QUEUE_TIMEOUT_S,
         "seconds a request may wait for room; then 503 with Retry-After"),
    )
)  # fmt: skip

_SCHEMA_LIMIT: Final = Option(
    "--schema-limit",
    "raise or lower one bound on clients' JSON schemas, e.g. max_nodes=16384 (repeatable; "
    "env DYN_SCHEMA_LIMITS, comma-separated; names and defaults: docs/structured-outputs.md)",
    key="schema_limits",
    default_from=lambda: addresses(os.environ.get("DYN_SCHEMA_LIMITS", "")),
    spec={"action": "append", "metavar": "NAME=VALUE"},
)

# The routing flags, each mirrored by a ``DYN_*`` environment variable (the flag wins).
_ROUTING: Final = (
    Option(
        "--router-mode",
        "round-robin, or kv: each request goes to the instance whose KV cache holds most of its "
        "prefix, balanced by load (from the engines' own KV events)",
        key="router_mode",
        default=d.DEFAULT_ROUTER_MODE,
        env="DYN_ROUTER_MODE",
        spec={"choices": d.ROUTER_MODES},
    ),
    *(
        Option(flag, text, key=key, default=default, env=env, spec={"type": float})
        for flag, key, env, default, text in (
            ("--kv-overlap-score-weight", "kv_overlap_score_weight", "DYN_KV_OVERLAP_SCORE_WEIGHT",
             d.DEFAULT_KV_OVERLAP_SCORE_WEIGHT,
             "kv mode: weight of the blocks still to prefill against the blocks already busy"),
            ("--router-temperature", "router_temperature", "DYN_ROUTER_TEMPERATURE",
             d.DEFAULT_ROUTER_TEMPERATURE,
             "kv mode: 0 picks the cheapest instance; higher samples among them"),
            ("--kv-predict-ttl", "kv_predict_ttl_s", "DYN_KV_PREDICT_TTL", d.DEFAULT_KV_PREDICT_TTL_S,
             "kv mode: seconds a routed request's prompt blocks still count as cached on its instance "
             "after its first token, unless the engine's own events say otherwise first (0: off)"),
        )
    ),
    Option(
        "--kv-endpoint-hosts",
        "kv mode: comma-separated hosts a worker's KV-event endpoint may be on besides the host "
        "of its own endpoint ('*': any)",
        key="kv_endpoint_hosts",
        default="",
        env="DYN_KV_ENDPOINT_HOSTS",
        convert=addresses,
    ),
)  # fmt: skip

FRONTEND_OPTIONS: Final = Options((*_PLANE, *_HTTP, _SCHEMA_LIMIT, *_ROUTING))
