"""``--router-mode round-robin``: each model's live instances in turn; it reads nothing of a request."""

from __future__ import annotations

import itertools
from collections.abc import Coroutine, Sequence, Set
from typing import TYPE_CHECKING, Any

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.routing.router import Prompts, Render, Route, RouterParts
from dynamo_prep.routing.settings import RouterSettings

if TYPE_CHECKING:  # annotations only: routing loads no formatter stack
    from dynamo_prep.discovery.catalog import LiveModel

__all__ = ["RoundRobin"]


class RoundRobin:
    """Round robin over a model's live instances, skipping the ones a request already tried."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count[int]] = {}

    @classmethod
    def from_settings(cls, settings: RouterSettings, parts: RouterParts) -> RoundRobin:
        del settings, parts  # no knob, no socket, no metric
        return cls()

    def pick(self, model: LiveModel, *, excluded: Set[str] = frozenset()) -> Instance | None:
        """The next instance in turn whose instance_id is not ``excluded``; None when none is left."""
        instances = sorted(model.instances.items())
        candidates = [instance for instance_id, instance in instances if instance_id not in excluded]
        if not candidates:
            return None
        turn = next(self._turns.setdefault(model.name, itertools.count()))
        return candidates[turn % len(candidates)]

    # -- Router -----------------------------------------------------------------------------------

    async def prompts(self, candidates: Sequence[Instance], render: Render) -> Prompts:
        return {}

    def choose(self, model: LiveModel, candidates: Sequence[Instance], prompts: Prompts) -> Route | None:
        chosen = {instance.instance_id for instance in candidates}
        instance = self.pick(model, excluded=model.instances.keys() - chosen)
        return None if instance is None else Route(instance)

    def dispatch(self, model_name: str, request_id: str, route: Route) -> None:
        pass

    def prefilled(self, model_name: str, request_id: str) -> None:
        pass

    def release(self, model_name: str, request_id: str) -> None:
        pass

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None:
        pass

    def instance_removed(self, model_name: str, instance: Instance) -> None:
        pass

    def components(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {}

    def close(self) -> None:
        pass
