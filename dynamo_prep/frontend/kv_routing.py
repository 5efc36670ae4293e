"""KV-aware routing for every served model: the instances' own KV events feed one index per model,
and each request goes where its prefix is cached (``routing.policy`` decides; this module wires).

The routing sequence of a request is the prompt rendered for each candidate's declared token, its
images found by that declaration's placeholder ids and named by their identity (the ``uuid`` the
worker also receives), hashed into the frontend's own block hashes: what an instance's engine
stored under the same tokens and images matches, whatever the engine's own hash function is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog
import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.kv_events import KVEvent, image_spans
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.metrics import KvMetrics
from dynamo_prep.routing.policy import (
    DEFAULT_OVERLAP_SCORE_WEIGHT,
    DEFAULT_TEMPERATURE,
    Decision,
    LoadTracker,
    choose,
    count_blocks,
)
from dynamo_prep.routing.subscriber import KvEventSubscriber

__all__ = ["KvRouting", "RoutingPrompt"]

log = structlog.get_logger("dynamo_prep.frontend")


@dataclass(frozen=True, slots=True)
class RoutingPrompt:
    """A request as one declaration renders it: its ids, and that declaration's placeholder ids."""

    request: PreprocessedRequest
    placeholder: Sequence[int]


@dataclass(slots=True)
class _Model:
    index: KvIndex
    load: LoadTracker
    turn: int = 0


class KvRouting:
    """The KV router of one frontend: a ``KvEventSink`` for the subscriber, a listener of the
    discovery watcher (instances come and go), and ``decide`` for the migration loop."""

    def __init__(
        self,
        *,
        overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
        temperature: float = DEFAULT_TEMPERATURE,
        metrics: KvMetrics | None = None,
        context: zmq.asyncio.Context | None = None,
        seed: int | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"the router temperature must be >= 0, got {temperature}")
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.metrics = metrics if metrics is not None else KvMetrics()
        self.subscriber = KvEventSubscriber(self, metrics=self.metrics, context=context)
        self._models: dict[str, _Model] = {}
        self._model_of: dict[str, str] = {}  # instance_id -> model
        self._rng = random.Random(seed)

    # -- the watcher's instances -----------------------------------------------------------------

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None:
        """Follow a new instance's KV events (or its changed record's); one index per model."""
        model = self._models.get(card.display_name)
        if model is None:
            model = _Model(KvIndex(card.kv_cache_block_size), LoadTracker())
            self._models[card.display_name] = model
        self._model_of[instance.instance_id] = card.display_name
        if instance.kv_events is not None:
            self.subscriber.add(instance)
        else:
            self.subscriber.remove(instance.instance_id)

    def instance_removed(self, model_name: str, instance: Instance) -> None:
        """An instance that expired or withdrew loses its blocks and its load."""
        self.subscriber.remove(instance.instance_id)
        self.reset(instance.instance_id)
        model = self._models.get(model_name)
        if model is not None:
            model.load.forget(instance.instance_id)
        self._model_of.pop(instance.instance_id, None)
        if model_name not in self._model_of.values():  # its last instance: a new card starts afresh
            self._models.pop(model_name, None)

    # -- KvEventSink ------------------------------------------------------------------------------

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        model = self._models.get(self._model_of.get(instance_id, ""))
        if model is not None:
            model.index.apply(instance_id, events)

    def reset(self, instance_id: str) -> None:
        model = self._models.get(self._model_of.get(instance_id, ""))
        if model is not None:
            model.index.reset(instance_id)

    # -- requests --------------------------------------------------------------------------------

    def decide(
        self, model_name: str, candidates: Sequence[Instance], prompts: Mapping[str | None, RoutingPrompt]
    ) -> Decision:
        """The instance among ``candidates`` (the prompt each declaration renders in ``prompts``)."""
        started = time.perf_counter()
        model = self._models.get(model_name)
        if model is None:
            raise RuntimeError(f"model {model_name!r} has no KV index (no instance was ever added)")
        block_size = model.index.block_size
        overlaps: dict[str, int] = {}
        by_declaration: dict[str | None, list[str]] = {}
        for instance in candidates:
            by_declaration.setdefault(instance.declared_token, []).append(instance.instance_id)
        for declared, ids in by_declaration.items():
            prompt = prompts[declared]
            tokens = prompt.request.token_ids
            images = image_spans(tokens, prompt.placeholder, [image.uuid for image in prompt.request.images])
            matched = model.index.match(request_block_hashes(tokens, block_size, images))
            overlaps.update((instance_id, matched.get(instance_id, 0)) for instance_id in ids)
        first = next(iter(prompts.values()))
        decision = choose(
            [instance.instance_id for instance in candidates],
            overlaps,
            count_blocks(len(first.request.token_ids), block_size),
            model.load.active(),
            model.index.held(),
            overlap_score_weight=self.overlap_score_weight,
            temperature=self.temperature,
            rng=self._rng,
            turn=model.turn,
        )
        model.turn += 1
        self.metrics.decided(decision, time.perf_counter() - started)
        return decision

    def dispatch(self, model_name: str, request_id: str, decision: Decision) -> None:
        """The request went where ``decision`` says: its blocks count as that instance's load."""
        model = self._models.get(model_name)
        if model is not None:
            model.load.dispatch(request_id, decision.instance_id, decision.prompt_blocks)

    def release(self, model_name: str, request_id: str) -> None:
        model = self._models.get(model_name)
        if model is not None:
            model.load.release(request_id)

    def blocks_held(self, model_name: str) -> Mapping[str, int]:
        """Blocks each instance of the model holds, by instance id (what ``/metrics`` and logs show)."""
        model = self._models.get(model_name)
        return model.index.held() if model is not None else {}
