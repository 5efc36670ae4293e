"""The routing modes: ``--router-mode`` names one line of ``ROUTERS`` (docs/routing.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dynamo_prep.routing.kv import KvRouting
from dynamo_prep.routing.round_robin import RoundRobin
from dynamo_prep.routing.router import Router, RouterParts
from dynamo_prep.routing.settings import RouterMode, RouterSettings

__all__ = ["ROUTERS", "build_router"]

ROUTERS: Mapping[RouterMode, Callable[[RouterSettings, RouterParts], Router]] = {
    "round-robin": RoundRobin.from_settings,
    "kv": KvRouting.from_settings,
}


def build_router(settings: RouterSettings, parts: RouterParts | None = None) -> Router:
    """The router of ``settings.mode``, given the settings whole."""
    return ROUTERS[settings.mode](settings, parts if parts is not None else RouterParts())
