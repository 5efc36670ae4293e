"""The GPU-free mock as a plug-in engine (``--engine mock``, the default).

It takes no engine flags, only its own options; it enforces the image contract of any engine
that can be emulated (``--flavor``, ``engines.registry.FLAVORS``); the worker publishes its KV
events (``--kv-events``, ``kv_publisher``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from dynamo_prep.engines.bridge import EngineBridge

__all__ = ["BRIDGE"]

NAME: Final = "mock"


def check_options(engine_args: Sequence[str], mock_options: Mapping[str, object]) -> None:
    """The mock takes no engine flags (its own options are all the worker's)."""
    del mock_options
    if engine_args:
        raise ValueError(
            f"unrecognized arguments for --engine {NAME}: {' '.join(engine_args)} "
            "(engine flags are passed to --engine vllm or sglang)"
        )


def engine_argv(model_dir: Path, engine_args: Sequence[str]) -> list[str]:
    """None: the mock is built from the worker's own options."""
    del model_dir, engine_args
    return []


def reasoning_flags(reasoning_parser: str | None, engine_args: Sequence[str]) -> tuple[str, ...]:
    """None: the mock writes answers for the declared parsers itself (``answer``)."""
    del reasoning_parser, engine_args
    return ()


def declared_image_token(engine: object | None) -> str | None:
    """What the mock engine declares: the emulated engine's declaration (``MockEngine``)."""
    token = getattr(engine, "declared_image_token", None)
    return token if isinstance(token, str) else None


BRIDGE: Final = EngineBridge(
    name=NAME,
    check_options=check_options,
    engine_argv=engine_argv,
    reasoning_flags=reasoning_flags,
    start="dynamo_prep.engines.mock.engine:MockEngine",
    kv_dialect=None,
    emulate=None,
    declared_image_token=declared_image_token,
)
