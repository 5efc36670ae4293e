"""The frontend process runner: start the components, stop them all on SIGTERM / SIGINT.

Components are named coroutines supervised together: the discovery watcher and the HTTP server
(``app.py`` on uvicorn), on one event loop and sharing the live ``ModelCatalog``. A signal stops
every component and exits 0; a component that ends on its own is a failure and exits 1. Logging
is configured by the CLI, never here.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.discovery.builder import PreprocessorBuilder
from dynamo_prep.discovery.catalog import ModelCatalog
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.discovery.trust import ServerCurve, TrustError
from dynamo_prep.discovery.watcher import DEFAULT_BIND, DiscoveryWatcher
from dynamo_prep.frontend.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    HttpSettings,
    create_app,
)
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.frontend.http_server import HttpServer, bind_http
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.router import Router
from dynamo_prep.protocol.discovery import DEFAULT_NAMESPACE

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "FrontendConfig", "run_frontend", "serve_frontend"]

log = structlog.get_logger("dynamo_prep.frontend")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_HTTP_HOST = "0.0.0.0"
DEFAULT_HTTP_PORT = 8000


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
    http: HttpSettings = field(default_factory=HttpSettings)

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
    ) -> FrontendConfig:
        """Embedded plane on ``DEFAULT_BIND`` unless told otherwise; CURVE needs both key options."""
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
            curve = ServerCurve.load(curve_secret_key, curve_allow_dir)
        if not 0 <= http_port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535, got {http_port}")
        if max_body_bytes < 1 or request_timeout_s <= 0:
            raise ValueError("--max-body-bytes and --request-timeout must be positive")
        return cls(
            bind=bind,
            connect=connect,
            namespace=namespace,
            model_path=Path(model_path) if model_path is not None else None,
            cache_dir=cache_dir,
            curve=curve,
            http_host=http_host,
            http_port=http_port,
            http=HttpSettings(max_body_bytes=max_body_bytes, request_timeout_s=request_timeout_s),
        )


def run_frontend(**options: Any) -> int:
    """Blocking entry point of ``dynamo-prep frontend``; ``options`` are ``FrontendConfig.from_options``'s."""
    try:
        config = FrontendConfig.from_options(**options)
    except (TrustError, ValueError) as exc:
        log.error("frontend_config_error", error=str(exc))
        return EXIT_CONFIG
    return asyncio.run(serve_frontend(config))


async def serve_frontend(config: FrontendConfig, *, stop: asyncio.Event | None = None) -> int:
    """Run until ``stop`` is set (or SIGTERM / SIGINT when in the main thread)."""
    stop = stop or asyncio.Event()
    with _stop_on_signals(stop):
        return await _serve(config, stop)


async def _serve(config: FrontendConfig, stop: asyncio.Event) -> int:
    context = zmq.asyncio.Context.instance()
    catalog = ModelCatalog()
    store = ModelFileStore(config.cache_dir)
    client = RequestPlaneClient(context)
    metrics = FrontendMetrics()  # this frontend's own registry, handed to every component
    watcher = _watcher(config, catalog, store, context, client, metrics)
    try:
        watcher.open()
    except (zmq.ZMQError, TrustError, ValueError) as exc:
        log.error("frontend_start_failed", error=str(exc), discovery=[*config.bind, *config.connect])
        return EXIT_FAILED
    try:
        sock = bind_http(config.http_host, config.http_port)
    except OSError as exc:
        watcher.close()
        log.error("frontend_start_failed", error=str(exc), http=f"{config.http_host}:{config.http_port}")
        return EXIT_FAILED
    app = create_app(catalog, client, router=Router(), settings=config.http, metrics=metrics)
    http = HttpServer(app, sock)
    log.info(
        "frontend_started",
        discovery=watcher.addresses,
        mode="bind" if config.bind else "connect",
        namespace=config.namespace,
        curve="on" if config.curve is not None else "off",
        model_path=str(config.model_path) if config.model_path else None,
        cache_dir=str(store.root),
        http_host=config.http_host,
        http_port=http.port,
    )
    try:
        return await _supervise(_components(watcher, http), stop)
    finally:
        await client.close()


def _watcher(  # noqa: PLR0917 - private; every argument is a distinct collaborator
    config: FrontendConfig,
    catalog: ModelCatalog,
    store: ModelFileStore,
    context: zmq.asyncio.Context,
    client: RequestPlaneClient,
    metrics: FrontendMetrics,
) -> DiscoveryWatcher:
    builder = PreprocessorBuilder(store, local_model_path=config.model_path, context=context)
    return DiscoveryWatcher(
        builder=builder,
        bind=config.bind,
        connect=config.connect,
        namespace=config.namespace,
        curve=config.curve,
        catalog=catalog,
        context=context,
        on_endpoint_lost=client.endpoint_lost,
        metrics=metrics.discovery,
    )


def _components(watcher: DiscoveryWatcher, http: HttpServer) -> dict[str, Coroutine[Any, Any, None]]:
    """Everything the frontend runs concurrently (both read and write one ``ModelCatalog``)."""
    return {"discovery_watcher": watcher.run(), "http_server": http.run()}


async def _supervise(components: Mapping[str, Coroutine[Any, Any, None]], stop: asyncio.Event) -> int:
    """Run components until ``stop`` or until one of them ends (a failure); cancel the rest."""
    tasks = {asyncio.create_task(coro, name=name): name for name, coro in components.items()}
    stopper = asyncio.create_task(stop.wait(), name="stop")
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    code = EXIT_OK
    for task, name in tasks.items():
        if task in done:
            code = EXIT_FAILED
            error = task.exception() if not task.cancelled() else None
            log.error("frontend_component_failed", component=name, error=repr(error))
    stopper.cancel()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, stopper, return_exceptions=True)
    log.info("frontend_stopped", exit_code=code)
    return code


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM / SIGINT set ``stop`` while inside (main thread only; elsewhere callers set ``stop``)."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: signal.Signals) -> None:
        log.info("frontend_stopping", signal=signum.name)
        stop.set()

    installed: list[signal.Signals] = []
    for signum in _STOP_SIGNALS:
        try:
            loop.add_signal_handler(signum, on_signal, signum)
        except (RuntimeError, ValueError):  # not the main thread
            break
        installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
