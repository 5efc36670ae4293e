"""A worker in front of a real engine (``--engine vllm|sglang``): start it, card it, serve it.

The engine is built from its own flags (``WorkerConfig.engine_args``, with ``--model-path`` as its
model unless they name one) by the bridge's runtime adapter, imported here only when asked for.
The card carries the engine's own figures (its block size as ``kv_cache_block_size``, its KV
blocks, batch limits and context length) and the announce the engine's own ``--kv-events-config``
publisher, so no relay sits between the engine and the frontend's KV router. ``--reasoning-parser``
is the worker's (the frontend parses answers) and also the engine's own (it holds a structured-output
grammar back until the reasoning ends), so it goes to the engine too, unless the engine runs without
its tokenizer (``--skip-tokenizer-init``); ``--tool-call-parser`` is the worker's only (vLLM's
engine flags have none: it is ``vllm serve``'s).
"""

from __future__ import annotations

from typing import Any

import structlog
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.base import EngineFacts, EngineRuntime
from dynamo_prep.engines.images import ImageFetcher
from dynamo_prep.engines.kv_config import kv_events_endpoint
from dynamo_prep.engines.registry import bridge
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.metrics import WorkerMetrics
from dynamo_prep.worker.server import Worker

__all__ = ["EngineArgsError", "engine_card", "engine_worker", "start_runtime"]

log = structlog.get_logger("dynamo_prep.worker")


class EngineArgsError(ValueError):
    """The engine's own parser refused the engine flags (its usage was printed to stderr)."""


def start_runtime(config: WorkerConfig) -> EngineRuntime:
    """Import the bridge and start the engine (blocking: the engine loads its model here).

    Raises ``EngineArgsError`` for flags the engine refuses; anything else the engine raises
    while starting propagates (the worker fails to start).
    """
    engine = bridge(config.engine)
    reasoning = engine.reasoning_flags(config.reasoning_parser, config.engine_args)
    if config.reasoning_parser is not None and not reasoning:
        log.info(
            "engine_reasoning_parser_not_passed",
            engine=config.engine,
            reasoning_parser=config.reasoning_parser,
        )
    argv = engine.engine_argv(config.model_dir, (*config.engine_args, *reasoning))
    runtime_type: Any = engine.load_start()
    images = ImageFetcher(policy=config.media)
    log.info("engine_starting", engine=config.engine, engine_args=argv)
    try:
        runtime: EngineRuntime = runtime_type.start(argv, images, config.model_dir)
    except SystemExit as exc:  # argparse's way of refusing a flag
        refused = f"--engine {config.engine} refused its flags (exit {exc.code}): {argv}"
        raise EngineArgsError(refused) from None
    return runtime


def engine_card(
    config: WorkerConfig, runtime: EngineRuntime, declared_token: str | None
) -> ModelDeploymentCard:
    """The model's card with the running engine's figures and declaration."""
    facts = runtime.facts
    return ModelDeploymentCard.from_model_dir(
        config.model_dir,
        served_name=config.served_name,
        migration_limit=config.migration_limit,
        kv_cache_block_size=facts.block_size,
        context_length=facts.context_length,
        runtime_config=_runtime_config(config, facts, declared_token),
    )


def engine_worker(
    config: WorkerConfig,
    card: ModelDeploymentCard,
    runtime: EngineRuntime,
    context: zmq.asyncio.Context,
) -> Worker:
    """The Worker serving ``runtime``: requests, the engine's KV-event publisher in every announce,
    and the engine's own unfinished count as a metric."""
    metrics = WorkerMetrics()
    metrics.track_engine_unfinished(runtime.unfinished_requests)
    metrics.include_engine_metrics()
    facts = runtime.facts
    kv_events = None
    if facts.kv_events_config is not None:
        kv_events = kv_events_endpoint(
            facts.kv_events_config,
            flavor=runtime.flavor,
            endpoint_host=config.endpoint_host,
            data_parallel_rank=facts.data_parallel_rank,
        )
    generation = GenerationServer(
        runtime.generate, check=metrics.counting_check(runtime.check, runtime.flavor)
    )
    return Worker.from_config(config, card, context, generation, metrics, kv_events=kv_events)


def _runtime_config(
    config: WorkerConfig, facts: EngineFacts, declared_token: str | None
) -> ModelRuntimeConfig:
    return ModelRuntimeConfig(
        context_length=facts.context_length,
        total_kv_blocks=facts.total_kv_blocks,
        max_num_seqs=facts.max_num_seqs,
        max_num_batched_tokens=facts.max_num_batched_tokens,
        image_placeholder_token=declared_token,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
    )
