"""One frontend process serving: start the components, stop them all on SIGTERM / SIGINT.

Components are named coroutines supervised together: the discovery watcher and the HTTP server
(``app.py`` on uvicorn), on one event loop (uvloop) and sharing the live ``ModelCatalog``. A signal
stops every component and exits 0; a component that ends on its own is a failure and exits 1.
``process.py`` runs this once, or ``http_supervisor.py`` runs it in each of ``--http-workers N`` children.
Logging is configured by the CLI (or the supervisor, per child), never here.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
from collections.abc import Coroutine, Mapping
from typing import Any

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.discovery.builder import PreprocessorBuilder
from dynamo_prep.discovery.catalog import ModelCatalog
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.discovery.trust import TrustError
from dynamo_prep.discovery.watcher import DiscoveryWatcher
from dynamo_prep.frontend.app import create_app
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.http_server import HttpServer, bind_http, new_event_loop
from dynamo_prep.frontend.load import LoadBoard
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.schema_checks import SchemaChecks
from dynamo_prep.lifecycle import EXIT_FAILED, EXIT_OK, on_stop_signals_in_loop
from dynamo_prep.limits import raise_limits
from dynamo_prep.loopwatch import LoopWatch
from dynamo_prep.routing.modes import build_router
from dynamo_prep.routing.router import Router, RouterParts

__all__ = ["GIL_SWITCH_INTERVAL_S", "run_in_loop", "serve_frontend"]

log = structlog.get_logger("dynamo_prep.frontend")
# Slow work runs in threads (large or slow renders, stop automata, model builds), but holds the GIL:
# the event loop waits up to one switch interval per waiting thread each time it wants the GIL back
# (CPython's default 5 ms: /live took 60-100 ms with 4 such threads busy). 1 ms bounds that.
GIL_SWITCH_INTERVAL_S = 0.001


def run_in_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` to completion on a fresh uvloop event loop, with ``GIL_SWITCH_INTERVAL_S``."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


async def serve_frontend(config: FrontendConfig, *, stop: asyncio.Event | None = None) -> int:
    """Run until ``stop`` is set (or SIGTERM / SIGINT when in the main thread)."""
    stop = stop or asyncio.Event()

    def on_signal(signum: signal.Signals) -> None:
        log.info("frontend_stopping", signal=signum.name)
        stop.set()

    with on_stop_signals_in_loop(on_signal):
        return await _serve(config, stop)


async def _serve(config: FrontendConfig, stop: asyncio.Event) -> int:
    context = zmq.asyncio.Context.instance()
    raise_limits(context)  # before the first socket: libzmq sizes its socket table then
    catalog = ModelCatalog()
    store = ModelFileStore(config.cache_dir)
    metrics = FrontendMetrics()  # this frontend's own registry, handed to every component
    board = LoadBoard(max_queued=config.pool.max_queued_requests, queue_timeout_s=config.pool.queue_timeout_s)
    client = RequestPlaneClient(
        context,
        stall_timeout_s=config.pool.worker_stall_timeout_s,
        first_token_timeout_s=config.http.first_token_timeout_s,
        stream_stall_timeout_s=config.pool.stream_stall_timeout_s,
        refused=metrics.request_plane_refused,
        metrics=metrics,
        busy=board.busy,
    )
    router = build_router(config.router, RouterParts(context, metrics.registry))
    watcher = _watcher(config, catalog, store, context, client, metrics, router, board)
    try:
        watcher.open()
    except (zmq.ZMQError, TrustError, ValueError) as exc:
        log.error("frontend_start_failed", error=str(exc), discovery=[*config.bind, *config.connect])
        return EXIT_FAILED
    try:
        sock = bind_http(config.http_host, config.http_port, reuse_port=config.http_workers > 1)
    except OSError as exc:
        watcher.close()
        log.error("frontend_start_failed", error=str(exc), http=f"{config.http_host}:{config.http_port}")
        return EXIT_FAILED
    schema_checks = SchemaChecks(config.http.schema_limits, metrics)
    app = create_app(
        catalog,
        client,
        router=router,
        board=board,
        settings=config.http,
        metrics=metrics,
        on_answered=watcher.model_answered,
        schema_checks=schema_checks,
    )
    http = HttpServer(app, sock, config.http, metrics)
    _settle_heap()
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
        router_mode=config.router.mode,
    )
    loop_watch = LoopWatch(on_stall=lambda stall: metrics.loop_stalls.labels(cause=stall.cause).inc())
    loop_watch.start()
    try:
        return await _supervise(_components(watcher, http, router), stop)
    finally:
        loop_watch.stop()
        router.close()
        await schema_checks.close()
        await client.close()


def _watcher(  # noqa: PLR0917 - private; every argument is a distinct collaborator
    config: FrontendConfig,
    catalog: ModelCatalog,
    store: ModelFileStore,
    context: zmq.asyncio.Context,
    client: RequestPlaneClient,
    metrics: FrontendMetrics,
    router: Router,
    board: LoadBoard,
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
        on_endpoint_expired=client.endpoint_expired,
        on_load=board.report,
        prober=client.answers,
        on_model_removed=store.release,
        metrics=metrics.discovery,
        listeners=[board, router],
    )


def _components(
    watcher: DiscoveryWatcher, http: HttpServer, router: Router
) -> dict[str, Coroutine[Any, Any, None]]:
    """Everything the frontend runs concurrently (they share one ``ModelCatalog``, and the router)."""
    return {"discovery_watcher": watcher.run(), "http_server": http.run(), **router.components()}


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


def _settle_heap() -> None:
    """Startup's objects (modules, functions, the app) live as long as the process: they leave the
    collector's view, so a full collection pauses the loop only for what serving created."""
    gc.collect()
    gc.freeze()
