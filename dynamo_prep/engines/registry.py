"""Every engine a worker can run: one line per engine (its folder's ``bridge``); callers ask here.

Adding an engine: docs/engines.md ("Adding an engine").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from dynamo_prep.engines.bridge import EngineBridge
from dynamo_prep.engines.mock.bridge import BRIDGE as MOCK
from dynamo_prep.engines.sglang.bridge import BRIDGE as SGLANG
from dynamo_prep.engines.vllm.bridge import BRIDGE as VLLM

__all__ = ["BRIDGES", "DEFAULT_ENGINE", "DEFAULT_FLAVOR", "ENGINES", "FLAVORS", "bridge", "emulated"]

# The table, in the order ``--engine`` lists them.
_TABLE: Final = (MOCK, VLLM, SGLANG)

BRIDGES: Final[Mapping[str, EngineBridge]] = MappingProxyType({engine.name: engine for engine in _TABLE})
ENGINES: Final = tuple(BRIDGES)
DEFAULT_ENGINE: Final = MOCK.name
# The engines whose image contract the mock enforces (``--flavor``), and its default.
FLAVORS: Final = tuple(sorted(name for name, engine in BRIDGES.items() if engine.emulate is not None))
DEFAULT_FLAVOR: Final = SGLANG.name


def bridge(name: str) -> EngineBridge:
    """The engine called ``name``; ValueError naming the known ones."""
    found = BRIDGES.get(name)
    if found is None:
        raise ValueError(f"unknown --engine {name!r} (known: {', '.join(ENGINES)})")
    return found


def emulated(flavor: str) -> EngineBridge:
    """The engine whose contract the mock enforces as ``flavor``; ValueError naming the known ones."""
    found = BRIDGES.get(flavor)
    if found is None or found.emulate is None:
        raise ValueError(f"unknown mock engine flavor {flavor!r} (known: {', '.join(FLAVORS)})")
    return found
