"""The ``dynamo-prep worker`` process: validated options, the mock engine, a Worker until a signal.

Every option is checked once, in ``WorkerConfig.from_options``; anything wrong (options, model
directory, CURVE keys, replies file) is a ``worker_start_failed`` error line and exit code 1,
never a worker that announces and then cannot serve. Logging is configured by the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.card import ModelCardError, ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.discovery.trust import ClientCurve, TrustError
from dynamo_prep.engines.base import FLAVORS, REPLY_FORMATS, Flavor, ReplyFormat
from dynamo_prep.engines.mock import MockContinuation, MockEngine
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.discovery import DEFAULT_HEARTBEAT_S, DEFAULT_NAMESPACE, DEFAULT_TTL_MS
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.metrics import WorkerMetrics
from dynamo_prep.worker.server import DEFAULT_DRAIN_TIMEOUT_S, Worker

__all__ = ["EXIT_ERROR", "EXIT_OK", "WorkerConfig", "run_worker"]

log = structlog.get_logger("dynamo_prep.worker")

EXIT_OK = 0
EXIT_ERROR = 1
DEFAULT_ENDPOINT_HOST = "127.0.0.1"
DEFAULT_TOKEN_DELAY_S = 0.02
EngineKind = Literal["mock"]
ENGINES: tuple[EngineKind, ...] = get_args(EngineKind)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Validated worker options (what the CLI flags mean, checked once)."""

    model_dir: Path
    discovery: tuple[str, ...]
    served_name: str | None = None
    declared_image_token: str | None = None
    legacy_expands_image_pad_token: bool = False
    namespace: str = DEFAULT_NAMESPACE
    endpoint_host: str = DEFAULT_ENDPOINT_HOST
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    ttl_ms: int = DEFAULT_TTL_MS
    curve: ClientCurve | None = None
    engine: EngineKind = "mock"
    flavor: Flavor = "sglang"
    token_delay_s: float = DEFAULT_TOKEN_DELAY_S
    replies: Path | None = None
    reply_format: ReplyFormat = "echo"
    migration_limit: int = 0
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    metrics_port: int | None = None

    @classmethod
    def from_options(
        cls,
        *,
        model_path: str | Path,
        discovery: Sequence[str],
        served_name: str | None = None,
        declared_image_token: str | None = None,
        legacy_expands_image_pad_token: bool = False,
        namespace: str = DEFAULT_NAMESPACE,
        endpoint_host: str = DEFAULT_ENDPOINT_HOST,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        ttl_ms: int = DEFAULT_TTL_MS,
        curve_secret_key: Path | None = None,
        curve_server_key: Path | None = None,
        engine: str = "mock",
        flavor: str = "sglang",
        token_delay_s: float = DEFAULT_TOKEN_DELAY_S,
        replies: str | Path | None = None,
        reply_format: str = "echo",
        migration_limit: int = 0,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        metrics_port: int | None = None,
    ) -> WorkerConfig:
        """Raises ValueError (TrustError for CURVE keys) naming the option that is wrong."""
        if not discovery:
            raise ValueError("--discovery needs at least one address")
        if declared_image_token is not None and legacy_expands_image_pad_token:
            raise ValueError("--declare-image-token and --legacy-expands-image-pad-token exclude each other")
        if declared_image_token == "":
            raise ValueError("--declare-image-token must not be empty")
        for option, value, known in (
            ("--engine", engine, ENGINES),
            ("--flavor", flavor, FLAVORS),
            ("--reply-format", reply_format, REPLY_FORMATS),
        ):
            if value not in known:
                raise ValueError(f"unknown {option} {value!r} (known: {', '.join(known)})")
        for option, number in (("--heartbeat", heartbeat_s), ("--ttl-ms", ttl_ms)):
            if not number > 0:
                raise ValueError(f"{option} must be > 0, got {number}")
        for option, number in (
            ("--token-delay", token_delay_s),
            ("--migration-limit", migration_limit),
            ("--drain-timeout", drain_timeout_s),
        ):
            if not number >= 0:
                raise ValueError(f"{option} must be >= 0, got {number}")
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {metrics_port}")
        return cls(
            model_dir=resolve_model_dir(model_path),
            discovery=tuple(discovery),
            served_name=served_name,
            declared_image_token=declared_image_token,
            legacy_expands_image_pad_token=legacy_expands_image_pad_token,
            namespace=namespace,
            endpoint_host=endpoint_host,
            heartbeat_s=heartbeat_s,
            ttl_ms=ttl_ms,
            curve=_client_curve(curve_secret_key, curve_server_key),
            engine=cast(EngineKind, engine),
            flavor=cast(Flavor, flavor),
            token_delay_s=token_delay_s,
            replies=Path(replies) if replies is not None else None,
            reply_format=cast(ReplyFormat, reply_format),
            migration_limit=migration_limit,
            drain_timeout_s=drain_timeout_s,
            metrics_port=metrics_port,
        )


def run_worker(**options: Any) -> int:
    """Blocking entry point of ``dynamo-prep worker``; ``options`` are ``WorkerConfig.from_options``'s.

    Returns the exit code: 0 after SIGTERM/SIGINT, 1 when the worker cannot start or fails.
    """
    try:
        config = WorkerConfig.from_options(**options)
        engine = _mock_engine(config)
        card = ModelDeploymentCard.from_model_dir(
            config.model_dir,
            served_name=config.served_name,
            migration_limit=config.migration_limit,
            runtime_config=ModelRuntimeConfig(image_placeholder_token=_declared_token(config, engine)),
        )
    except (ModelCardError, TrustError, OSError, ValueError) as exc:
        log.error("worker_start_failed", model_path=str(options.get("model_path")), error=str(exc))
        return EXIT_ERROR
    return asyncio.run(_serve_until_signalled(lambda context: _worker(config, card, engine, context)))


def _mock_engine(config: WorkerConfig) -> MockContinuation:
    """The GPU-free engine; a model directory or replies file it cannot load is a start failure."""
    return MockContinuation(
        MockEngine(
            config.model_dir,
            flavor=config.flavor,
            token_delay_s=config.token_delay_s,
            replies=config.replies,
            reply_format=config.reply_format,
        )
    )


def _worker(
    config: WorkerConfig, card: ModelDeploymentCard, engine: MockContinuation, context: zmq.asyncio.Context
) -> Worker:
    metrics = WorkerMetrics()
    legacy = {"expands_image_pad_token": True} if config.legacy_expands_image_pad_token else None
    return Worker(
        card,
        config.model_dir,
        discovery=config.discovery,
        namespace=config.namespace,
        endpoint_host=config.endpoint_host,
        heartbeat_s=config.heartbeat_s,
        ttl_ms=config.ttl_ms,
        legacy_runtime=legacy,
        curve=config.curve,
        context=context,
        generation=GenerationServer(
            engine.generate, check=metrics.counting_check(engine.check_contract, config.flavor)
        ),
        drain_timeout_s=config.drain_timeout_s,
        metrics=metrics,
        metrics_port=config.metrics_port,
    )


def _declared_token(config: WorkerConfig, engine: MockContinuation) -> str | None:
    """An explicit ``--declare-image-token`` wins; a legacy worker declares nothing; else the engine's."""
    if config.declared_image_token is not None:
        token, source = config.declared_image_token, "flag"
    elif config.legacy_expands_image_pad_token:
        token, source = None, "legacy"
    else:
        token = engine.engine.declared_image_token
        source = "engine" if token is not None else "none"
    log.info("worker_declared_image_token", token=token, source=source)
    return token


def _client_curve(secret_key: Path | None, server_key: Path | None) -> ClientCurve | None:
    if secret_key is None and server_key is None:
        return None
    if secret_key is None or server_key is None:
        raise TrustError("CURVE needs both --curve-secret-key and --curve-server-key")
    return ClientCurve.load(secret_key, server_key)


async def _serve_until_signalled(make_worker: Callable[[zmq.asyncio.Context], Worker]) -> int:
    # Handlers go in before anything is logged, so a SIGTERM right after worker_started is graceful.
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    context = zmq.asyncio.Context()
    try:
        worker = make_worker(context)
        try:
            await worker.start()
        except (zmq.ZMQError, OSError) as exc:
            log.error("worker_start_failed", error=str(exc))
            return EXIT_ERROR
        return await _run_until(worker, stopping)
    finally:
        # Every socket is closed with a bounded linger, so this waits at most that long.
        context.term()


async def _run_until(worker: Worker, stopping: asyncio.Event) -> int:
    running = asyncio.create_task(worker.run())
    signalled = asyncio.create_task(stopping.wait())
    await asyncio.wait({running, signalled}, return_when=asyncio.FIRST_COMPLETED)
    code = EXIT_OK
    if running.done() and running.exception() is not None:
        log.error("worker_failed", error=repr(running.exception()))
        code = EXIT_ERROR
    try:
        await asyncio.wait_for(worker.stop(), timeout=worker.stop_timeout_s)
    except TimeoutError:
        log.error("worker_stop_timeout", timeout_s=worker.stop_timeout_s)
        code = EXIT_ERROR
    signalled.cancel()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await running
    return code
