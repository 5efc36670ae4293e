"""The ``dynamo-prep worker`` process: validated options, an engine, a Worker until a signal.

The engine is the mock (``worker.mock``) or a real one (``worker.engine``: vLLM or SGLang, built
from its own flags). Stopping is the same for both: on SIGTERM or SIGINT the worker withdraws its
card, drains (in-flight requests may finish for ``--drain-timeout``, the rest are aborted in the
engine), closes its sockets, then shuts a real engine down and exits 0. A real engine that dies, or
any engine that hangs (no step for ``--engine-stall-timeout`` with requests in flight), makes the
worker withdraw, fail its requests over at once (503) and exit 1, so the orchestrator restarts it.
The mock worker's engine can be made to hang and its loop to starve by signals, to exercise that
from outside (``worker.mock.MOCK_FAULT_SIGNALS``).

A worker that cannot start logs ``worker_start_failed`` before anything is announced (never a
worker that announces and then cannot serve): exit code 2 for wrong options
(``WorkerConfig.from_options``, or engine flags the engine's own parser refuses), 1 for a model
directory, replies file, engine or socket it cannot use. Logging is configured by the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
import zmq
import zmq.asyncio

from dynamo_prep.card import ModelCardError, ModelDeploymentCard
from dynamo_prep.discovery.trust import TrustError
from dynamo_prep.engines.base import EngineRuntime
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.lifecycle import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, new_event_loop, on_stop_signals_in_loop
from dynamo_prep.loopwatch import LoopWatch
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessError
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.engine import EngineArgsError, engine_card, engine_worker, start_runtime
from dynamo_prep.worker.mock import MockContinuation, mock_card, mock_engine, mock_worker
from dynamo_prep.worker.server import Worker

__all__ = ["run_worker"]

log = structlog.get_logger("dynamo_prep.worker")

MakeWorker = Callable[[zmq.asyncio.Context], Worker]


def run_worker(**options: Any) -> int:
    """Blocking entry point of ``dynamo-prep worker``; ``options`` are ``WorkerConfig.from_options``'s.

    Returns the exit code (``dynamo_prep.lifecycle``): 0 after SIGTERM/SIGINT, 2 for wrong options
    (CURVE key files and engine flags included), 1 when the worker cannot start or fails.
    """
    try:
        config = WorkerConfig.from_options(**options)
    except (TrustError, ValueError) as exc:
        log.error("worker_start_failed", model_path=str(options.get("model_path")), error=str(exc))
        return EXIT_CONFIG
    try:
        check_servable(config)
    except (ModelCardError, OSError, ValueError) as exc:
        log.error("worker_start_failed", model_path=str(config.model_dir), error=str(exc))
        return EXIT_FAILED
    if config.real_engine:
        return _run(_serve_engine(config))
    try:
        engine = mock_engine(config)
        card = mock_card(config, declared_token(config, engine.engine.declared_image_token))
    except (ModelCardError, OSError, ValueError) as exc:
        log.error("worker_start_failed", model_path=str(config.model_dir), error=str(exc))
        return EXIT_FAILED
    return _run(_serve_mock(config, card, engine))


def _run(serving: Coroutine[Any, Any, int]) -> int:
    """``serving`` on uvloop, as the frontend's loop and ``vllm serve``'s run."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(serving)


def check_servable(config: WorkerConfig) -> None:
    """What a frontend builds from this directory (card, chat template, tokenizer), built once and
    tried on a one-line chat, before any engine loads: a model it could not serve fails the start
    with the file and the field (``ModelCardError``, ``TokenizerError``, a template error)."""
    card = ModelDeploymentCard.from_model_dir(config.model_dir, served_name=config.served_name)
    preprocessor = OpenAIPreprocessor.new(card, config.model_dir)
    try:
        preprocessor.tokenize(
            {"model": card.display_name, "messages": [{"role": "user", "content": "Hello"}]}
        )
    except PreprocessError as exc:
        where = getattr(preprocessor.formatter, "source", str(config.model_dir))
        raise ModelCardError(f"{where}: its chat_template cannot render a one-line chat: {exc}") from exc


def declared_token(config: WorkerConfig, engine_token: str | None) -> str | None:
    """An explicit ``--declare-image-token`` wins; a legacy worker declares nothing; else the engine's."""
    if config.declared_image_token is not None:
        token, source = config.declared_image_token, "flag"
    elif config.legacy_expands_image_pad_token:
        token, source = None, "legacy"
    else:
        token = engine_token
        source = "engine" if token is not None else "none"
    log.info("worker_declared_image_token", declared_token=token, source=source, engine=config.engine)
    return token


async def _serve(make_worker: MakeWorker) -> int:
    stopping = asyncio.Event()
    # Handlers go in before anything is logged, so a SIGTERM right after worker_started is graceful.
    with on_stop_signals_in_loop(lambda _signum: stopping.set()):
        return await _serve_signalled(make_worker, stopping)


async def _serve_mock(config: WorkerConfig, card: ModelDeploymentCard, engine: MockContinuation) -> int:
    images = ImageFetcher(policy=config.media)
    try:
        return await _serve(lambda context: mock_worker(config, card, engine, context, images))
    finally:
        await images.aclose()


async def _serve_engine(config: WorkerConfig) -> int:
    """Start the engine (a SIGTERM meanwhile stops the worker once it is up), serve, shut it down."""
    stopping = asyncio.Event()
    with on_stop_signals_in_loop(lambda _signum: stopping.set()):
        try:
            runtime = start_runtime(config)
        except EngineArgsError as exc:
            log.error("worker_start_failed", model_path=str(config.model_dir), error=str(exc))
            return EXIT_CONFIG
        except Exception as exc:  # the engine could not load: nothing was announced
            log.exception("worker_start_failed", model_path=str(config.model_dir), error=repr(exc))
            return EXIT_FAILED
        try:
            if stopping.is_set():  # stopped while the engine was loading: nothing to announce
                return EXIT_OK
            card = engine_card(config, runtime, declared_token(config, runtime.declared_image_token))
            # Installed again now: the engine may have put its own handlers in place while starting.
            with on_stop_signals_in_loop(lambda _signum: stopping.set()):
                return await _serve_signalled(
                    lambda context: engine_worker(config, card, runtime, context), stopping, runtime
                )
        except (ModelCardError, OSError, ValueError) as exc:
            log.error("worker_start_failed", model_path=str(config.model_dir), error=str(exc))
            return EXIT_FAILED
        finally:
            await runtime.shutdown()
            log.info("engine_stopped", engine=config.engine)


async def _serve_signalled(
    make_worker: MakeWorker, stopping: asyncio.Event, runtime: EngineRuntime | None = None
) -> int:
    context = zmq.asyncio.Context()
    try:
        worker = make_worker(context)
        try:
            await worker.start()
        except (zmq.ZMQError, OSError) as exc:
            log.error("worker_start_failed", error=str(exc))
            return EXIT_FAILED
        loop_watch = LoopWatch()  # its output loop: event_loop_stalled, with whose the stall was
        loop_watch.start()
        try:
            return await _run_until(worker, stopping, None if runtime is None else runtime.wait_dead())
        finally:
            loop_watch.stop()
    finally:
        # Every socket is closed with a bounded linger, so this waits at most that long.
        context.term()


async def _run_until(worker: Worker, stopping: asyncio.Event, engine_dead: Awaitable[str] | None) -> int:
    """Serve until a signal (exit 0), or until the worker fails, its engine dies or hangs (exit 1:
    withdrawn, its requests failed over at once)."""
    running = asyncio.create_task(worker.run())
    signalled = asyncio.create_task(stopping.wait())
    stalled = asyncio.create_task(worker.engine_stalled())
    watched: set[asyncio.Future[Any]] = {running, signalled, stalled}
    dead = None if engine_dead is None else asyncio.ensure_future(engine_dead)
    if dead is not None:
        watched.add(dead)
    await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    code = EXIT_OK
    if running.done() and running.exception() is not None:
        log.error("worker_failed", error=repr(running.exception()))
        code = EXIT_FAILED
    if dead is not None and dead.done():
        log.error("engine_dead", reason=dead.result())
        code = EXIT_FAILED
    if stalled.done():
        code = EXIT_FAILED  # the watchdog logged engine_stalled
    try:
        await asyncio.wait_for(worker.stop(drain=code == EXIT_OK), timeout=worker.stop_timeout_s)
    except TimeoutError:
        log.error("worker_stop_timeout", timeout_s=worker.stop_timeout_s)
        code = EXIT_FAILED
    for task in (signalled, running, dead, stalled):
        if task is not None:
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await running
    return code
