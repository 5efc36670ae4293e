"""The ``dynamo-prep worker`` process: validated options, the mock engine, a Worker until a signal.

With ``--kv-events`` the mock engine runs behind a paged prefix cache (``engines.mock_kv``) whose
events a ``KvEventPublisher`` bound on ``endpoint_host`` publishes; the Worker starts it, announces
its addresses and closes it after the drain.

A worker that cannot start logs ``worker_start_failed`` before anything is announced (never a
worker that announces and then cannot serve): exit code 2 for wrong options
(``WorkerConfig.from_options``), 1 for a model directory, replies file or socket it cannot use.
Logging is configured by the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.card import ModelCardError, ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.discovery.trust import TrustError
from dynamo_prep.engines.base import GenerateFn
from dynamo_prep.engines.mock.engine import MockContinuation, MockEngine
from dynamo_prep.engines.mock.kv import MockKvEngine
from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.engines.mock.kv_publisher import KvEventPublisher
from dynamo_prep.lifecycle import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, on_stop_signals_in_loop
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.metrics import WorkerMetrics
from dynamo_prep.worker.server import Worker

__all__ = ["run_worker"]

log = structlog.get_logger("dynamo_prep.worker")


def run_worker(**options: Any) -> int:
    """Blocking entry point of ``dynamo-prep worker``; ``options`` are ``WorkerConfig.from_options``'s.

    Returns the exit code (``dynamo_prep.lifecycle``): 0 after SIGTERM/SIGINT, 2 for wrong options
    (CURVE key files included), 1 when the worker cannot start or fails.
    """
    try:
        config = WorkerConfig.from_options(**options)
    except (TrustError, ValueError) as exc:
        log.error("worker_start_failed", model_path=str(options.get("model_path")), error=str(exc))
        return EXIT_CONFIG
    try:
        engine = _mock_engine(config)
        card = ModelDeploymentCard.from_model_dir(
            config.model_dir,
            served_name=config.served_name,
            migration_limit=config.migration_limit,
            runtime_config=ModelRuntimeConfig(image_placeholder_token=_declared_token(config, engine)),
        )
    except (ModelCardError, OSError, ValueError) as exc:
        log.error("worker_start_failed", model_path=str(config.model_dir), error=str(exc))
        return EXIT_FAILED
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
    generate: GenerateFn = engine.generate
    kv_publisher = None
    if config.kv_events:
        address = f"tcp://{config.endpoint_host}:*"
        kv_publisher = KvEventPublisher(address, replay_endpoint=address, context=context)
        # A seed per process, as vLLM's unseeded hashes: engine hashes mean nothing outside it.
        cache = PagedPrefixCache(card.kv_cache_block_size, config.kv_blocks, seed=os.urandom(16))
        metrics.track_kv_blocks(lambda: len(cache))
        generate = MockKvEngine(
            engine,
            cache,
            kv_publisher.publish,
            prefill_ms_per_1k=config.prefill_ms_per_1k,
            on_admit=metrics.count_prefill,
        ).generate
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
            generate, check=metrics.counting_check(engine.check_contract, config.flavor)
        ),
        drain_timeout_s=config.drain_timeout_s,
        metrics=metrics,
        metrics_port=config.metrics_port,
        kv_publisher=kv_publisher,
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
    log.info("worker_declared_image_token", declared_token=token, source=source)
    return token


async def _serve_until_signalled(make_worker: Callable[[zmq.asyncio.Context], Worker]) -> int:
    stopping = asyncio.Event()
    # Handlers go in before anything is logged, so a SIGTERM right after worker_started is graceful.
    with on_stop_signals_in_loop(lambda _signum: stopping.set()):
        context = zmq.asyncio.Context()
        try:
            worker = make_worker(context)
            try:
                await worker.start()
            except (zmq.ZMQError, OSError) as exc:
                log.error("worker_start_failed", error=str(exc))
                return EXIT_FAILED
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
        code = EXIT_FAILED
    try:
        await asyncio.wait_for(worker.stop(), timeout=worker.stop_timeout_s)
    except TimeoutError:
        log.error("worker_stop_timeout", timeout_s=worker.stop_timeout_s)
        code = EXIT_FAILED
    signalled.cancel()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await running
    return code
