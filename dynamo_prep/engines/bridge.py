"""What one engine brings to the worker: one ``EngineBridge`` per engine folder (``<name>/bridge.py``).

``engines.registry`` lists them; docs/engines.md says what each part is for and how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

if TYPE_CHECKING:  # the registry is read by the CLI for its defaults: nothing heavy at import
    from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "SKIP_TOKENIZER_INIT",
    "EmulatedContract",
    "EngineBridge",
    "KvDialect",
    "reasoning_flags_by",
    "refuse_mock_options",
]

# An engine run without its tokenizer gets no --reasoning-parser (its parser needs one).
SKIP_TOKENIZER_INIT: Final = "--skip-tokenizer-init"


@dataclass(frozen=True, slots=True)
class KvDialect:
    """How an engine reads its ``--kv-events-config`` (``engines.kv_config``).

    ``needs_enable``: it publishes only with ``enable_kv_cache_events: true`` (then ``publisher``
    defaults to ``"zmq"``); else whenever ``publisher`` is ``"zmq"`` (default ``"null"``).
    ``bind_marks``: what in a PUB address makes it bind. ``honours_bind``: its ``bind`` key
    overrides that guess. ``formats``: the ``format`` values it accepts (None: it has no such key).
    """

    needs_enable: bool
    bind_marks: tuple[str, ...]
    honours_bind: bool = False
    formats: tuple[str, ...] | None = None


class EmulatedContract(NamedTuple):
    """An engine's image contract as the mock enforces it for one model.

    ``pattern``: the id sequence that must occur once per image (None: the model takes no images);
    ``strip``: the ids one image occupies in the prompt (removed before echoing the user text);
    ``spelling``: the placeholder as text, for messages; ``mismatch(expected, found)``: the
    engine's own complaint; ``declared_image_token``: what a worker of that engine declares.
    """

    pattern: tuple[int, ...] | None
    strip: tuple[int, ...] | None
    spelling: str | None
    mismatch: Callable[[int, int], str]
    declared_image_token: str | None


@dataclass(frozen=True, slots=True)
class EngineBridge:
    """One engine, as the worker and the mock see it.

    ``name``: its ``--engine`` (and, when the mock can emulate it, ``--flavor``) value.
    ``check_options(engine_args, mock_options)``: refuse (ValueError) the flags it does not take;
    ``mock_options`` are the mock's options that were given (flag -> value).
    ``engine_argv(model_dir, engine_args, reasoning_parser)``: its own command line (its parser
    reads it when it starts); ``reasoning_flags(reasoning_parser, engine_args)``: our
    ``--reasoning-parser`` in its own spelling (empty: it has none).
    ``start``: ``"module:attribute"`` of what the worker starts, imported only then (a real engine:
    a runtime class with ``start(argv, images, model_dir)``; the mock: its engine class).
    ``kv_dialect``: how its ``--kv-events-config`` reads (None: the worker publishes for it,
    ``--kv-events``). ``emulate(model_dir, tokenizer)``: its image contract for the mock (None:
    the mock does not emulate it). ``declared_image_token(engine)``: the per-image token a worker
    in front of it declares, read from the running engine (or the mock's stand-in).
    """

    name: str
    check_options: Callable[[Sequence[str], Mapping[str, object]], None]
    engine_argv: Callable[[Path, Sequence[str]], list[str]]
    reasoning_flags: Callable[[str | None, Sequence[str]], tuple[str, ...]]
    start: str
    kv_dialect: KvDialect | None
    emulate: Callable[[Path, Tokenizer], EmulatedContract] | None
    declared_image_token: Callable[[object | None], str | None]

    @property
    def real(self) -> bool:
        """A real engine, run in the worker's process (it reads its own KV-events config)."""
        return self.kv_dialect is not None

    def load_start(self) -> Any:
        """Import what ``start`` names (a real engine's runtime module imports the engine lazily)."""
        module, _, attribute = self.start.partition(":")
        return getattr(importlib.import_module(module), attribute)


def refuse_mock_options(name: str) -> Callable[[Sequence[str], Mapping[str, object]], None]:
    """A real engine's ``check_options``: every flag the worker does not know is the engine's own;
    none of the mock's options."""

    def check(engine_args: Sequence[str], mock_options: Mapping[str, object]) -> None:
        del engine_args  # the engine's own parser reads them when it starts
        given = [option for option, value in mock_options.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: options of --engine mock, not of --engine {name}")

    return check


def reasoning_flags_by(
    spelling: Callable[[str], str | None],
) -> Callable[[str | None, Sequence[str]], tuple[str, ...]]:
    """A real engine's ``reasoning_flags``: its ``--reasoning-parser`` for ours (``spelling``: its
    name for ours, None when it has none), as its server would get it; empty when the engine runs
    without its tokenizer (``--skip-tokenizer-init``: the frontend parses anyway)."""

    def flags(reasoning_parser: str | None, engine_args: Sequence[str]) -> tuple[str, ...]:
        if reasoning_parser is None or SKIP_TOKENIZER_INIT in engine_args:
            return ()
        name = spelling(reasoning_parser)
        return ("--reasoning-parser", name) if name is not None else ()

    return flags
