"""Command-line options declared once: each builds its argparse flag and names the config keyword it fills.

A subcommand's ``Options`` is the one place its flags are written: ``add_to`` builds the parser,
``values`` turns the parsed flags into the keywords of the subcommand's validated config
(``WorkerConfig.from_options`` for ``worker``). Light on purpose: argparse and os only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from dynamo_prep.protocol.discovery import DEFAULT_NAMESPACE

__all__ = ["CURVE_ALLOW_DIR", "NAMESPACE", "Option", "Options", "addresses", "listed"]


def addresses(value: str) -> list[str]:
    """``ADDR[,ADDR]``: the comma-separated items of a flag's value."""
    return [address.strip() for address in value.split(",") if address.strip()]


def listed(values: list[str] | None) -> list[str] | None:
    """A repeatable flag's values, each space- or comma-separated, as one list (None: not given)."""
    return None if values is None else [item for value in values for item in addresses(value)]


@dataclass(frozen=True, slots=True)
class Option:
    """One flag: its argparse declaration and the config keyword it fills.

    ``key``: the config keyword (None: the flag is accepted and fills nothing); ``convert``: from
    the parsed value to the keyword's. ``env``: a variable mirroring the flag (the flag wins); its
    help then names both and the default. ``exclusive``: flags of one name exclude each other.
    ``aliases``: other spellings of the flag. A ``flag`` without dashes is a positional argument.
    ``spec``: every other ``add_argument`` keyword (``type``, ``action``, ``metavar``, ...).
    """

    flag: str
    help: str
    key: str | None = None
    default: Any = None
    convert: Callable[[Any], Any] | None = None
    env: str | None = None
    exclusive: str | None = None
    spec: Mapping[str, Any] = field(default_factory=dict)
    # A default read when the parser is built (e.g. from the environment), instead of ``default``.
    default_from: Callable[[], Any] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return str(self.spec.get("dest", self.flag.lstrip("-").replace("-", "_")))

    def add_to(self, parser: Any) -> None:
        extra = dict(self.spec)
        if self.env is None:
            positional = not self.flag.startswith("-")
            if not positional and extra.get("action") not in ("store_true", "store_false"):
                extra.setdefault(
                    "default", self.default if self.default_from is None else self.default_from()
                )
            parser.add_argument(self.flag, *self.aliases, help=self.help, **extra)
            return
        shown = f"{self.default:g}" if isinstance(self.default, float) else self.default
        extra.setdefault("type", str)
        parser.add_argument(
            self.flag,
            default=os.environ.get(self.env) or self.default,
            help=f"{self.help} (env {self.env}; default {shown})",
            **extra,
        )

    def value(self, args: argparse.Namespace) -> Any:
        parsed = getattr(args, self.dest)
        return parsed if self.convert is None else self.convert(parsed)


@dataclass(frozen=True, slots=True)
class Options:
    """A subcommand's flags, in the order its help lists them."""

    options: tuple[Option, ...]

    def __iter__(self) -> Iterator[Option]:
        return iter(self.options)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        groups: dict[str, Any] = {}
        for option in self.options:
            target: Any = parser
            if option.exclusive is not None:
                target = groups.get(option.exclusive) or parser.add_mutually_exclusive_group()
                groups[option.exclusive] = target
            option.add_to(target)

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The config keywords the parsed ``args`` fill."""
        return {option.key: option.value(args) for option in self.options if option.key is not None}

    def keys(self) -> frozenset[str]:
        """The config keywords these flags fill."""
        return frozenset(option.key for option in self.options if option.key is not None)


# Every process on the discovery plane takes it.
NAMESPACE: Final = Option(
    "--namespace",
    "discovery namespace: only cards of this namespace are seen",
    key="namespace",
    default=DEFAULT_NAMESPACE,
    env="DYN_NAMESPACE",
)
CURVE_ALLOW_DIR: Final = Option(
    "--curve-allow-dir",
    "directory of allowed worker public keys",
    key="curve_allow_dir",
    spec={"type": Path},
)
