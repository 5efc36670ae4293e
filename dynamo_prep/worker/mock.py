"""A worker in front of the GPU-free mock engine (``--engine mock``).

Request images are fetched and decoded as for a real engine (the same ``ImageFetcher``, the same
``--allowed-media-*`` policy), and the mock gets each image's identity from the fetcher, as vLLM
does. With ``--kv-events`` the mock engine runs behind a paged prefix cache (``engines.mock.kv``)
whose events a ``KvEventPublisher`` bound on ``endpoint_host`` publishes; the Worker starts it,
announces its addresses and closes it after the drain. Its scheduler (``engines.mock.scheduler``)
runs at most ``--slots`` requests at once.

Faults to try from outside, on a real process (``MOCK_FAULT_SIGNALS``): SIGUSR1 holds the engine's
steps (a hung engine core: the process, its heartbeats and its request plane go on) or releases
them when held; SIGUSR2 keeps the event loop busy for ``STARVE_S`` seconds (a starved worker).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import msgspec
import structlog
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.base import EngineOutput, GenerateFn
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.mock.engine import MockContinuation, MockEngine
from dynamo_prep.engines.mock.kv import MockKvEngine
from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.engines.mock.kv_publisher import KvEventPublisher
from dynamo_prep.engines.mock.scheduler import MockScheduler
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.metrics import WorkerMetrics
from dynamo_prep.worker.server import Worker

__all__ = [
    "MOCK_FAULT_SIGNALS",
    "STARVE_S",
    "MockContinuation",
    "mock_card",
    "mock_engine",
    "mock_worker",
    "with_images",
]

log = structlog.get_logger("dynamo_prep.worker")

MOCK_FAULT_SIGNALS = {"hold_or_release_engine": signal.SIGUSR1, "starve_loop": signal.SIGUSR2}
# How long SIGUSR2 keeps the loop busy: longer than a test's short TTL (the default TTL is 3 s).
STARVE_S = 2.5


def mock_engine(config: WorkerConfig) -> MockContinuation:
    """The GPU-free engine; a model directory or replies file it cannot load is a start failure."""
    return MockContinuation(
        MockEngine(
            config.model_dir,
            flavor=config.flavor,
            token_delay_s=config.token_delay_s,
            replies=config.replies,
            reply_format=config.reply_format,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
        )
    )


def mock_card(config: WorkerConfig, declared_token: str | None) -> ModelDeploymentCard:
    """The model's card; with ``--kv-events`` it says the mock cache's capacity, as an engine does."""
    capacity = config.kv_blocks if config.kv_events else None
    return ModelDeploymentCard.from_model_dir(
        config.model_dir,
        served_name=config.served_name,
        migration_limit=config.migration_limit,
        runtime_config=ModelRuntimeConfig(
            image_placeholder_token=declared_token,
            total_kv_blocks=capacity,
            max_num_seqs=config.slots,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
        ),
    )


def with_images(generate: GenerateFn, images: ImageFetcher) -> GenerateFn:
    """``generate`` once the request's images are fetched and decoded, each named by the fetcher's
    identity (its bytes' digest for an http(s) image), as a real engine gets them; a refused image
    is an ``ImageError`` (a 400) before the engine sees the request."""

    async def generate_with_images(request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        if request.images:
            fetched = await images.fetch(request.images)
            named = [
                msgspec.structs.replace(ref, uuid=image.uuid)
                for ref, image in zip(request.images, fetched, strict=True)
            ]
            request = msgspec.structs.replace(request, images=named)
        async for step in generate(request):
            yield step

    return generate_with_images


def mock_worker(
    config: WorkerConfig,
    card: ModelDeploymentCard,
    engine: MockContinuation,
    context: zmq.asyncio.Context,
    images: ImageFetcher,
) -> Worker:
    metrics = WorkerMetrics()
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
        ).generate
    scheduler = MockScheduler(generate, slots=config.slots)  # images are fetched before a slot is taken
    _on_fault_signals(scheduler)
    generation = GenerationServer(
        with_images(scheduler.generate, images),
        check=metrics.counting_check(engine.check_contract, config.flavor),
    )
    return Worker.from_config(config, card, context, generation, metrics, kv_publisher=kv_publisher)


def _on_fault_signals(scheduler: MockScheduler) -> None:
    """SIGUSR1 holds or releases the engine, SIGUSR2 starves the loop (from the running loop)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        MOCK_FAULT_SIGNALS["hold_or_release_engine"],
        lambda: scheduler.release() if scheduler.held else scheduler.hold(),
    )
    loop.add_signal_handler(MOCK_FAULT_SIGNALS["starve_loop"], _starve)


def _starve() -> None:
    """Keep the loop busy running Python for ``STARVE_S`` (it lets the GIL go only when CPython
    makes it, every switch interval), as a worker busy with a slow request would."""
    log.warning("mock_loop_starving", seconds=STARVE_S)
    until = time.monotonic() + STARVE_S
    spins = 0
    while time.monotonic() < until:
        spins += 1
    log.warning("mock_loop_starved", seconds=STARVE_S, spins=spins)
