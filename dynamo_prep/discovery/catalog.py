"""The live model set the HTTP layer reads: only models that can serve a request right now.

A model is listed once it has a built preprocessor AND at least one live instance (Dynamo users
see models "listed before they are routable" otherwise). The model set is swapped in whole when a
model is built or removed; a model's instance maps are read-only views the catalog updates in
place, so a heartbeat-driven join or leave costs O(1) even with thousands of instances. Writers
and readers share one event loop, so a reader sees a consistent model between two awaits.

Each instance also carries its declared ``image_placeholder_token`` (None: the checkpoint
default), because a mixed vLLM + SGLang pool must render every request for the instance it is
routed to. A model seen but not built yet is *pending*: the HTTP layer answers 503, not 404.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.preprocessor import OpenAIPreprocessor

__all__ = ["CHECKPOINT_DEFAULT", "LiveModel", "ModelCatalog", "ModelStatus"]

CHECKPOINT_DEFAULT = "checkpoint default"
ModelStatus = Literal["live", "pending", "unknown"]


@dataclass(frozen=True, slots=True)
class LiveModel:
    """One servable model: its canonical card, its preprocessor, and its live instances."""

    name: str
    card: ModelDeploymentCard
    mdcsum: str
    preprocessor: OpenAIPreprocessor
    formatter_kind: str
    instances: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    image_tokens: Mapping[str, str | None] = field(default_factory=lambda: MappingProxyType({}))
    model_dir: Path | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def with_instances(
        self, instances: Mapping[str, str], image_tokens: Mapping[str, str | None] | None = None
    ) -> LiveModel:
        """A copy with another instance set (instance_id -> request-plane endpoint).

        ``image_tokens`` (instance_id -> declared token) defaults to the canonical card's
        declaration for instances it does not name.
        """
        default = self.card.runtime_config.image_placeholder_token
        known = {**self.image_tokens, **(image_tokens or {})}
        tokens = {instance_id: known.get(instance_id, default) for instance_id in instances}
        return replace(
            self, instances=MappingProxyType(dict(instances)), image_tokens=MappingProxyType(tokens)
        )

    def image_token_of(self, instance_id: str) -> str | None:
        """The token an instance declared (None: it renders the checkpoint default)."""
        return self.image_tokens.get(instance_id, self.card.runtime_config.image_placeholder_token)

    def composition(self) -> dict[str, int]:
        """Declared token (or "checkpoint default") -> number of live instances declaring it."""
        counts = Counter(
            self.image_token_of(instance_id) or CHECKPOINT_DEFAULT for instance_id in self.instances
        )
        return dict(sorted(counts.items()))


class ModelCatalog:
    """Model name -> ``LiveModel``; written by the watcher, read by request handlers."""

    def __init__(self) -> None:
        self._models: Mapping[str, LiveModel] = MappingProxyType({})
        self._pending: frozenset[str] = frozenset()
        self._endpoints: dict[str, dict[str, str]] = {}
        self._tokens: dict[str, dict[str, str | None]] = {}

    def get(self, name: str) -> LiveModel | None:
        """The model if it can serve (built and at least one instance), else None."""
        model = self._models.get(name)
        return model if model is not None and model.instances else None

    def names(self) -> list[str]:
        """Sorted names of the models that can serve now (what ``/v1/models`` lists)."""
        return sorted(name for name, model in self._models.items() if model.instances)

    def status(self, name: str) -> ModelStatus:
        """live: servable now; pending: announced, but unbuilt or without instances; else unknown."""
        if self.get(name) is not None:
            return "live"
        return "pending" if name in self._pending or name in self._models else "unknown"

    def mark_pending(self, name: str) -> None:
        """A model whose first card arrived and whose preprocessor is being built."""
        self._pending = self._pending | {name}

    def publish(self, model: LiveModel) -> None:
        """Add or replace a built model; the catalog owns its instance maps from now on."""
        self._pending = self._pending - {model.name}
        endpoints = dict(model.instances)
        tokens = {instance_id: model.image_token_of(instance_id) for instance_id in endpoints}
        self._endpoints[model.name], self._tokens[model.name] = endpoints, tokens
        owned = replace(model, instances=MappingProxyType(endpoints), image_tokens=MappingProxyType(tokens))
        self._swap(lambda models: models.__setitem__(model.name, owned))

    def remove(self, name: str) -> None:
        self._pending = self._pending - {name}
        self._endpoints.pop(name, None)
        self._tokens.pop(name, None)
        self._swap(lambda models: models.pop(name, None))

    def set_instance(self, name: str, instance_id: str, endpoint: str, *, image_token: str | None) -> None:
        """Record a live instance of an already built model (no-op for unbuilt models)."""
        if name in self._endpoints:
            self._endpoints[name][instance_id] = endpoint
            self._tokens[name][instance_id] = image_token

    def remove_instance(self, name: str, instance_id: str) -> None:
        if name in self._endpoints:
            self._endpoints[name].pop(instance_id, None)
            self._tokens[name].pop(instance_id, None)

    def _swap(self, change: Callable[[dict[str, LiveModel]], object]) -> None:
        """Copy, change, swap: a reader holding the old mapping keeps a consistent view."""
        models = dict(self._models)
        change(models)
        self._models = MappingProxyType(models)
