"""The live model set the HTTP layer reads: only models that can serve a request right now.

A model is listed once it has a built preprocessor AND at least one live instance (Dynamo users
see models "listed before they are routable" otherwise). Entries are immutable snapshots swapped
in whole: the watcher writes from the event loop, readers (the HTTP layer, possibly another
thread) always see a consistent model without locks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.preprocessor import OpenAIPreprocessor

__all__ = ["LiveModel", "ModelCatalog"]


@dataclass(frozen=True, slots=True)
class LiveModel:
    """One servable model: its canonical card, its preprocessor, and its live instances."""

    name: str
    card: ModelDeploymentCard
    mdcsum: str
    preprocessor: OpenAIPreprocessor
    formatter_kind: str
    instances: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def with_instances(self, instances: Mapping[str, str]) -> LiveModel:
        """A copy with another instance set (instance_id -> request-plane endpoint)."""
        return replace(self, instances=MappingProxyType(dict(instances)))


class ModelCatalog:
    """Model name -> ``LiveModel``; written by the watcher, read by request handlers."""

    def __init__(self) -> None:
        self._models: Mapping[str, LiveModel] = MappingProxyType({})

    def get(self, name: str) -> LiveModel | None:
        """The model if it can serve (built and at least one instance), else None."""
        model = self._models.get(name)
        return model if model is not None and model.instances else None

    def names(self) -> list[str]:
        """Sorted names of the models that can serve now (what ``/v1/models`` lists)."""
        return sorted(name for name, model in self._models.items() if model.instances)

    def publish(self, model: LiveModel) -> None:
        """Add or replace a built model."""
        self._swap(lambda models: models.__setitem__(model.name, model))

    def remove(self, name: str) -> None:
        self._swap(lambda models: models.pop(name, None))

    def set_instance(self, name: str, instance_id: str, endpoint: str) -> None:
        """Record a live instance of an already built model (no-op for unbuilt models)."""
        model = self._models.get(name)
        if model is not None:
            self.publish(model.with_instances({**model.instances, instance_id: endpoint}))

    def remove_instance(self, name: str, instance_id: str) -> None:
        model = self._models.get(name)
        if model is not None and instance_id in model.instances:
            remaining = {key: value for key, value in model.instances.items() if key != instance_id}
            self.publish(model.with_instances(remaining))

    def _swap(self, change: Callable[[dict[str, LiveModel]], object]) -> None:
        """Copy, change, swap: a reader holding the old mapping keeps a consistent view."""
        models = dict(self._models)
        change(models)
        self._models = MappingProxyType(models)
