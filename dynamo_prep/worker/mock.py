"""A worker in front of the GPU-free mock engine (``--engine mock``).

Request images are fetched and decoded as for a real engine (the same ``ImageFetcher``, the same
``--allowed-media-*`` policy), and the mock gets each image's identity from the fetcher, as vLLM
does. With ``--kv-events`` the mock engine runs behind a paged prefix cache (``engines.mock.kv``)
whose events a ``KvEventPublisher`` bound on ``endpoint_host`` publishes; the Worker starts it,
announces its addresses and closes it after the drain.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import msgspec
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.base import EngineOutput, GenerateFn
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.mock.engine import MockContinuation, MockEngine
from dynamo_prep.engines.mock.kv import MockKvEngine
from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.engines.mock.kv_publisher import KvEventPublisher
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.metrics import WorkerMetrics
from dynamo_prep.worker.server import Worker

__all__ = ["mock_card", "mock_engine", "mock_worker", "with_images"]


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
    generation = GenerationServer(
        with_images(generate, images), check=metrics.counting_check(engine.check_contract, config.flavor)
    )
    return Worker.from_config(config, card, context, generation, metrics, kv_publisher=kv_publisher)
