"""Register a real SGLang or vLLM worker: declare its image token, publish its card, serve it.

A worker process that already holds its engine calls ``register(engine, ...)`` once the engine
is up. The declaration is read from the engine itself with the matching adapter (SGLang: the
loaded processor's ``mm_tokens.image_token``; vLLM: nothing), so the card states the engine's
real contract. The returned ``Worker`` is serving; the caller stops it (``await worker.stop()``:
withdraw, drain, close).

An engine started with ``--kv-events-config`` publishes its KV-cache events itself; ``register``
takes the same config and advertises where a frontend can follow them (``engines.kv_config``), so
no relay is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.discovery.announcing import Announcing
from dynamo_prep.engines.base import GenerateFn
from dynamo_prep.engines.kv_config import kv_events_endpoint
from dynamo_prep.engines.registry import bridge
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.parsing import check_parser_names
from dynamo_prep.protocol.discovery import DEFAULT_NAMESPACE
from dynamo_prep.worker.config import DEFAULT_ENDPOINT_HOST
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.server import Worker

__all__ = ["register"]

log = structlog.get_logger("dynamo_prep.worker")


async def register(
    engine: object,
    *,
    flavor: str,
    model_path: str | Path,
    discovery: Sequence[str],
    served_name: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    endpoint_host: str = DEFAULT_ENDPOINT_HOST,
    generate: GenerateFn | None = None,
    migration_limit: int = 0,
    kv_cache_block_size: int | None = None,
    kv_events_config: Mapping[str, Any] | str | object | None = None,
    data_parallel_rank: int = 0,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> Worker:
    """Build the card with the engine's declaration, start a serving ``Worker`` and return it.

    ``generate`` streams the engine's outputs for a ``PreprocessedRequest`` (``EngineOutput``s, in
    ``engines.base``); without it the worker only publishes its card and serves its files.
    ``kv_cache_block_size`` is the engine's (vLLM ``--block-size``, SGLang ``--page-size``; None:
    the card's default): the frontend reads the engine's KV events in blocks of the card's size.

    ``kv_events_config`` is the engine's ``--kv-events-config`` (a dict, its JSON text or the
    engine's config object) and ``data_parallel_rank`` the engine's rank, whose ports it offsets:
    every announce then carries the publisher's address (wildcard hosts become
    ``endpoint_host``). ``tool_call_parser`` / ``reasoning_parser`` are vLLM's parser names the card
    declares (the frontend parses the answers with them). Raises ValueError for a config the engine
    would refuse or an unknown parser name.
    """
    check_parser_names(tool_call_parser, reasoning_parser)
    kv_events = None
    if kv_events_config is not None:
        kv_events = kv_events_endpoint(
            kv_events_config,
            flavor=flavor,
            endpoint_host=endpoint_host,
            data_parallel_rank=data_parallel_rank,
        )
    token = bridge(flavor).declared_image_token(engine)
    log.info(
        "worker_declared_image_token",
        declared_token=token,
        source="engine" if token is not None else "none",
        engine=flavor,
    )
    model_dir = resolve_model_dir(model_path)
    sizes = {} if kv_cache_block_size is None else {"kv_cache_block_size": kv_cache_block_size}
    card = ModelDeploymentCard.from_model_dir(
        model_dir,
        served_name=served_name,
        migration_limit=migration_limit,
        runtime_config=ModelRuntimeConfig(
            image_placeholder_token=token,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        ),
        **sizes,
    )
    worker = Worker(
        card,
        model_dir,
        announcing=Announcing(discovery=tuple(discovery), namespace=namespace),
        endpoint_host=endpoint_host,
        generation=GenerationServer(generate) if generate is not None else None,
        kv_events=kv_events,
    )
    await worker.start_serving()
    return worker
