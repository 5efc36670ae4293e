"""Which live instance takes a request: round robin over a model's instances.

The router only chooses; rendering the prompt for the chosen instance's declaration is the
migration loop's job (``migration.py``), with the preprocessors of ``declarations.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Set

from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.protocol.discovery import Instance

__all__ = ["Router"]


class Router:
    """Round robin over a model's live instances, skipping the ones a request already tried."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count[int]] = {}

    def pick(self, model: LiveModel, *, excluded: Set[str] = frozenset()) -> Instance | None:
        """The next instance in turn whose instance_id is not ``excluded``; None when none is left."""
        instances = sorted(model.instances.items())
        candidates = [instance for instance_id, instance in instances if instance_id not in excluded]
        if not candidates:
            return None
        turn = next(self._turns.setdefault(model.name, itertools.count()))
        return candidates[turn % len(candidates)]
