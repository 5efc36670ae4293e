"""The live model set the HTTP layer reads: only models that can serve a request right now.

A model is listed once it has a built preprocessor AND at least one live instance (Dynamo users
see models "listed before they are routable" otherwise). The model set and each model's instance
map (typed read-only for readers) are updated in place, so a model built or removed, and a
heartbeat-driven join or leave, cost O(1) even with thousands of models and instances. Writers
and readers share one event loop, so a reader sees a consistent model between two awaits. A model
seen but not built yet is *pending*: the HTTP layer answers 503, not 404. Per-model records are
untracked by the GC (no per-model object in its full collections: a 10,000-name flood made those
pauses last hundreds of ms).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Literal

import msgspec

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import Instance, declared_label

__all__ = ["LiveModel", "ModelCatalog", "ModelStatus"]

ModelStatus = Literal["live", "pending", "unknown"]


class LiveModel(msgspec.Struct, frozen=True, gc=False):
    """One servable model: its canonical card, its preprocessor, and its live instances by id."""

    name: str
    card: ModelDeploymentCard
    mdcsum: str
    preprocessor: OpenAIPreprocessor
    instances: Mapping[str, Instance] = msgspec.field(default_factory=dict)
    model_dir: str | None = None  # a str, as BuiltModel's
    created: int = msgspec.field(default_factory=lambda: int(time.time()))

    def composition(self) -> dict[str, int]:
        """Declared token (or ``checkpoint default``) -> number of live instances declaring it."""
        counts = Counter(declared_label(instance.declared_token) for instance in self.instances.values())
        return dict(sorted(counts.items()))


class ModelCatalog:
    """Model name -> ``LiveModel``; written by the watcher, read by request handlers."""

    def __init__(self) -> None:
        self._models: dict[str, LiveModel] = {}
        self._pending: set[str] = set()
        self._instances: dict[str, dict[str, Instance]] = {}

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
        self._pending.add(name)

    def publish(self, model: LiveModel) -> None:
        """Add or replace a built model; the catalog owns its instance map from now on."""
        self._pending.discard(model.name)
        instances = dict(model.instances)
        self._instances[model.name] = instances
        owned = msgspec.structs.replace(model, instances=instances)
        self._models[model.name] = owned

    def remove(self, name: str) -> None:
        self._pending.discard(name)
        self._instances.pop(name, None)
        self._models.pop(name, None)

    def set_instance(self, name: str, instance: Instance) -> None:
        """Record a live instance (or its changed record) of a built model; no-op for unbuilt ones."""
        instances = self._instances.get(name)
        if instances is not None:
            instances[instance.instance_id] = instance

    def remove_instance(self, name: str, instance_id: str) -> None:
        instances = self._instances.get(name)
        if instances is not None:
            instances.pop(instance_id, None)
