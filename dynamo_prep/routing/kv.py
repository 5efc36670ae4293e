"""``--router-mode kv``: the instances' own KV events feed one index per model, and each request
goes where its prefix is cached (``routing.policy`` decides; this module wires).

The routing sequence of a request is the prompt rendered for each candidate's declared token, its
images found by that declaration's placeholder ids and named by their identity (the ``uuid`` the
worker also receives), hashed into the frontend's own block hashes: what an instance's engine
stored under the same tokens and images matches, whatever the engine's own hash function is.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.kv_events import KVEvent, image_spans
from dynamo_prep.routing.endpoints import KvEndpointRules
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.metrics import KvMetrics
from dynamo_prep.routing.policy import Decision, KvRouter, count_blocks
from dynamo_prep.routing.router import Prompts, Render, Route, RouterParts, RoutingPrompt
from dynamo_prep.routing.settings import RouterSettings
from dynamo_prep.routing.subscriber import KvEventSubscriber

if TYPE_CHECKING:  # annotations only: routing loads no formatter stack
    from dynamo_prep.discovery.catalog import LiveModel

__all__ = ["KvRouting"]


class KvRouting:
    """The KV router of one frontend: a ``KvEventSink`` for the subscriber, a listener of the
    discovery watcher (instances come and go), and the migration loop's ``Router``."""

    def __init__(
        self,
        settings: RouterSettings | None = None,
        *,
        metrics: KvMetrics | None = None,
        context: zmq.asyncio.Context | None = None,
        seed: int | None = None,
    ) -> None:
        settings = settings if settings is not None else RouterSettings(mode="kv")
        self.settings = settings
        self.metrics = metrics if metrics is not None else KvMetrics()
        rules = KvEndpointRules(settings.kv_endpoint_hosts)
        self.subscriber = KvEventSubscriber(self, metrics=self.metrics, context=context, rules=rules)
        self._models: dict[str, KvRouter] = {}
        self._model_of: dict[str, str] = {}  # instance_id -> model
        self._seed = seed
        self.metrics.predicted_blocks.set_function(self.predicted_blocks)

    @classmethod
    def from_settings(cls, settings: RouterSettings, parts: RouterParts) -> KvRouting:
        return cls(settings, metrics=KvMetrics(parts.registry), context=parts.context)

    # -- the watcher's instances -----------------------------------------------------------------

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None:
        """Follow a new instance's KV events (or its changed record's); one index per model."""
        if card.display_name not in self._models:
            self._models[card.display_name] = KvRouter(
                KvIndex(
                    card.kv_cache_block_size,
                    on_refused=self.metrics.index_refused,
                    predict_ttl_s=self.settings.predict_ttl_s,
                ),
                overlap_score_weight=self.settings.kv_overlap_score_weight,
                temperature=self.settings.temperature,
                seed=self._seed,
            )
        self._model_of[instance.instance_id] = card.display_name
        self._models[card.display_name].index.set_capacity(instance.instance_id, instance.total_kv_blocks)
        if instance.kv_events is not None:
            self.subscriber.add(instance)
        else:
            self.subscriber.remove(instance.instance_id)

    def instance_removed(self, model_name: str, instance: Instance) -> None:
        """An instance that expired or withdrew loses its blocks and its load."""
        self.subscriber.remove(instance.instance_id)
        self.reset(instance.instance_id)
        router = self._models.get(model_name)
        if router is not None:
            router.load.forget(instance.instance_id)
            router.index.forget(instance.instance_id)
        self._model_of.pop(instance.instance_id, None)
        if model_name not in self._model_of.values():  # its last instance: a new card starts afresh
            self._models.pop(model_name, None)

    # -- KvEventSink ------------------------------------------------------------------------------

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        router = self._models.get(self._model_of.get(instance_id, ""))
        if router is not None:
            router.index.apply(instance_id, events)

    def reset(self, instance_id: str) -> None:
        router = self._models.get(self._model_of.get(instance_id, ""))
        if router is not None:
            router.index.reset(instance_id)

    # -- requests --------------------------------------------------------------------------------

    async def prompts(self, candidates: Sequence[Instance], render: Render) -> Prompts:
        """The request rendered for each declaration among ``candidates`` (its blocks are hashed as
        each declaration's engine stores them)."""
        return {declared: await render(declared) for declared in {i.declared_token for i in candidates}}

    def choose(self, model: LiveModel, candidates: Sequence[Instance], prompts: Prompts) -> Route:
        decision = self.decide(model.name, candidates, prompts)
        return Route(model.instances[decision.instance_id], decision)

    def decide(self, model_name: str, candidates: Sequence[Instance], prompts: Prompts) -> Decision:
        """The instance among ``candidates`` (the prompt each declaration renders in ``prompts``)."""
        started = time.perf_counter()
        router = self._models.get(model_name)
        if router is None:
            raise RuntimeError(f"model {model_name!r} has no KV index (no instance was ever added)")
        block_size = router.index.block_size
        overlaps: dict[str, int] = {}
        hashes: dict[str | None, list[int]] = {}
        by_declaration: dict[str | None, list[str]] = {}
        for instance in candidates:
            by_declaration.setdefault(instance.declared_token, []).append(instance.instance_id)
        matched: dict[str, int] = {}
        for declared, ids in by_declaration.items():
            if hashes and not prompts[declared].request.images:
                # Without images every declaration renders the same ids: hashed and matched once.
                hashes[declared] = next(iter(hashes.values()))
            else:
                hashes[declared] = self._hashes(prompts[declared], block_size)
                matched = router.index.match(hashes[declared])
            overlaps.update((instance_id, matched.get(instance_id, 0)) for instance_id in ids)
        first = next(iter(prompts.values()))
        decision = router.choose(
            overlaps,
            count_blocks(len(first.request.token_ids), block_size),
            {instance.instance_id: hashes[instance.declared_token] for instance in candidates},
            {i.instance_id: i.total_kv_blocks for i in candidates if i.total_kv_blocks is not None},
        )
        self.metrics.decided(decision, time.perf_counter() - started)
        return decision

    @staticmethod
    def _hashes(prompt: RoutingPrompt, block_size: int) -> list[int]:
        """The prompt's block hashes, its images found by the declaration's placeholder ids."""
        request = prompt.request
        images = image_spans(request.token_ids, prompt.placeholder, [image.uuid for image in request.images])
        return request_block_hashes(request.token_ids, block_size, images)

    def dispatch(self, model_name: str, request_id: str, route: Route) -> None:
        """The request went where ``route`` says: its blocks count as that instance's load."""
        router = self._models.get(model_name)
        if router is not None and route.decision is not None:
            router.dispatch(request_id, route.decision)

    def prefilled(self, model_name: str, request_id: str) -> None:
        """The request's first output arrived: its instance is done prefilling it."""
        router = self._models.get(model_name)
        if router is not None:
            router.prefilled(request_id)

    def release(self, model_name: str, request_id: str) -> None:
        router = self._models.get(model_name)
        if router is not None:
            router.release(request_id)

    def active_blocks(self, model_name: str) -> Mapping[str, int]:
        """Blocks the running requests of each instance hold (``LoadTracker``), by instance id."""
        router = self._models.get(model_name)
        return router.load.active() if router is not None else {}

    def predicted_blocks(self) -> int:
        """Blocks counted as cached by prediction (``KvIndex.predict``), every model together."""
        return sum(router.index.predicted.count() for router in self._models.values())

    def blocks_held(self, model_name: str) -> Mapping[str, int]:
        """Blocks each instance of the model holds, by instance id (what ``/metrics`` and logs show)."""
        router = self._models.get(model_name)
        return router.index.held() if router is not None else {}

    # -- the frontend's components ----------------------------------------------------------------

    def components(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"kv_events": self.subscriber.run()}

    def close(self) -> None:
        self.subscriber.close()
