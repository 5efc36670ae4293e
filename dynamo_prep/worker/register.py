"""Register a real SGLang or vLLM worker: declare its image token, publish its card, serve it.

A worker process that already holds its engine calls ``register(engine, ...)`` once the engine
is up. The declaration is read from the engine itself with the matching adapter (SGLang: the
loaded processor's ``mm_tokens.image_token``; vLLM: nothing), so the card states the engine's
real contract. The returned ``Worker`` is serving; the caller stops it (``await worker.stop()``:
withdraw, drain, close).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.base import Flavor, GenerateFn
from dynamo_prep.engines.declare import declared_image_token
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.discovery import DEFAULT_NAMESPACE
from dynamo_prep.worker.config import DEFAULT_ENDPOINT_HOST
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.server import Worker

__all__ = ["register"]

log = structlog.get_logger("dynamo_prep.worker")


async def register(
    engine: object,
    *,
    flavor: Flavor,
    model_path: str | Path,
    discovery: Sequence[str],
    served_name: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    endpoint_host: str = DEFAULT_ENDPOINT_HOST,
    generate: GenerateFn | None = None,
    migration_limit: int = 0,
) -> Worker:
    """Build the card with the engine's declaration, start a serving ``Worker`` and return it.

    ``generate`` streams the engine's outputs for a ``PreprocessedRequest`` (``EngineOutput``s, in
    ``engines.base``); without it the worker only publishes its card and serves its files.
    """
    token = declared_image_token(engine, flavor)
    log.info(
        "worker_declared_image_token",
        declared_token=token,
        source="engine" if token is not None else "none",
        flavor=flavor,
    )
    model_dir = resolve_model_dir(model_path)
    card = ModelDeploymentCard.from_model_dir(
        model_dir,
        served_name=served_name,
        migration_limit=migration_limit,
        runtime_config=ModelRuntimeConfig(image_placeholder_token=token),
    )
    worker = Worker(
        card,
        model_dir,
        discovery=discovery,
        namespace=namespace,
        endpoint_host=endpoint_host,
        generation=GenerationServer(generate) if generate is not None else None,
    )
    await worker.start_serving()
    return worker
