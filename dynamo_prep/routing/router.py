"""What the frontend asks of a router, whichever mode it routes by (docs/routing.md).

A router chooses, and is told what became of its choice; rendering, admission and moving a
request elsewhere are the migration loop's (``frontend/migration.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.routing.policy import Decision

if TYPE_CHECKING:  # a router that keeps no sockets needs no ZeroMQ; routing loads no formatter stack
    import zmq.asyncio
    from prometheus_client import CollectorRegistry

    from dynamo_prep.discovery.catalog import LiveModel

__all__ = ["Prompts", "Render", "Route", "Router", "RouterParts", "RoutingPrompt"]


@dataclass(frozen=True, slots=True)
class RoutingPrompt:
    """A request as one declaration renders it: its ids, and that declaration's placeholder ids."""

    request: PreprocessedRequest
    placeholder: Sequence[int]


# The request's prompt per declared image token (None: the checkpoint's default), as a router read it.
Prompts = Mapping[str | None, RoutingPrompt]
# Renders the request for a declaration (the migration loop's renders, cached per request).
Render = Callable[[str | None], Awaitable[RoutingPrompt]]


@dataclass(frozen=True, slots=True)
class Route:
    """A router's choice: the instance, and the KV router's figures when it chose by them."""

    instance: Instance
    decision: Decision | None = None


@dataclass(frozen=True, slots=True)
class RouterParts:
    """What a router may take from its frontend: the ZeroMQ context its sockets share, and the
    frontend's metrics registry (None: a private one)."""

    context: zmq.asyncio.Context | None = None
    registry: CollectorRegistry | None = None


class Router(Protocol):
    """Chooses the instance of each attempt of a request, and follows what it needs to.

    Per attempt the migration loop calls ``prompts`` (before its room check: it may await), then
    ``choose`` among the instances with room (nothing awaits between), ``dispatch`` once the
    request goes, ``prefilled`` at its first output (or its end without one), ``release`` when the
    attempt ends however it ends. The discovery watcher tells it of instances (``InstanceListener``);
    the frontend runs its ``components`` and ``close``s it at the end.
    """

    async def prompts(self, candidates: Sequence[Instance], render: Render) -> Prompts:
        """What the router reads of the request to choose among ``candidates`` ({}: nothing)."""
        ...

    def choose(self, model: LiveModel, candidates: Sequence[Instance], prompts: Prompts) -> Route | None:
        """The instance among ``candidates`` (all of ``model``, none tried); None: none of them."""
        ...

    def dispatch(self, model_name: str, request_id: str, route: Route) -> None: ...

    def prefilled(self, model_name: str, request_id: str) -> None: ...

    def release(self, model_name: str, request_id: str) -> None: ...

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None: ...

    def instance_removed(self, model_name: str, instance: Instance) -> None: ...

    def components(self) -> dict[str, Coroutine[Any, Any, None]]:
        """What the router runs beside the frontend's own components, by name."""
        ...

    def close(self) -> None: ...
