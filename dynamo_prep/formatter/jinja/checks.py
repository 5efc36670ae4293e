"""Calls that could build something huge, checked before they run: string methods, filters, ``tojson``.

The sandbox routes every call through ``STR_METHOD_CHECKS`` (by method name, on a ``str``) and every
filter through ``bounded_filter``; each check computes what the call would build from its
arguments alone, and ``Budget.check`` refuses it before anything is allocated.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dynamo_prep.formatter.jinja.bounds import Budget, current, is_int

__all__ = ["FILTER_CHECKS", "STR_METHOD_CHECKS", "bounded_filter", "bounded_json"]

_JSON_ESCAPE_GROWTH = 12  # the most one character grows in JSON: an astral one as two \\uXXXX escapes

Check = Callable[[Budget, Any, tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]


def _width_method(
    budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    width = args[0] if args else kwargs.get("width")
    if is_int(width):
        budget.check("a padded string", width)
    return args


def _expandtabs(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    size = args[0] if args else kwargs.get("tabsize", 8)
    if is_int(size):
        budget.check("an expanded string", len(owner) + owner.count("\t") * max(size, 0))
    return args


def _replace(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    if len(args) >= 2:
        budget.check(
            "a replaced string", replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else -1)
        )
    return args


def replaced_size(text: Any, old: Any, new: Any, count: Any) -> int:
    """The length of ``text.replace(old, new, count)``, computed without building it."""
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    occurrences = text.count(old) if old else len(text) + 1
    if is_int(count) and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _join(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    if len(args) != 1 or kwargs:
        return args
    items = list(args[0])  # a generator can yield one big string many times: count before joining
    budget.check("a joined string", joined_size(budget, items, len(owner)))
    return (items,)


def joined_size(budget: Budget, items: list[Any], separator: int) -> int:
    return sum(
        len(item) if isinstance(item, str) else budget.weight(item) for item in items
    ) + separator * max(len(items) - 1, 0)


def _translate(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    table = args[0] if args else None
    if isinstance(table, Mapping):
        longest = max((len(value) for value in table.values() if isinstance(value, str)), default=1)
        budget.check("a translated string", len(owner) * max(longest, 1))
    return args


def _format(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    budget.format_widths(owner, args, kwargs)
    return args


def _format_map(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    budget.format_widths(owner, (), args[0] if args and isinstance(args[0], Mapping) else {})
    return args


STR_METHOD_CHECKS: Mapping[str, Check] = {
    "center": _width_method,
    "ljust": _width_method,
    "rjust": _width_method,
    "zfill": _width_method,
    "expandtabs": _expandtabs,
    "replace": _replace,
    "join": _join,
    "translate": _translate,
    "format": _format,
    "format_map": _format_map,
}


def bounded_json(
    value: Any,
    *,
    ensure_ascii: bool,
    indent: int | str | None,
    separators: tuple[str, str] | None,
    sort_keys: bool,
) -> str:
    """``json.dumps`` with these options, built chunk by chunk and stopped at ``max_chars`` (the
    filter wrapper charges the result)."""
    budget = current()
    budget.indent(indent)
    encoder = _encoder(ensure_ascii, indent, separators, sort_keys)
    if indent is None and budget.weight(value) * _JSON_ESCAPE_GROWTH <= budget.limits.max_chars:
        return encoder.encode(value)  # one shot in C: at most this long
    chunks: list[str] = []
    size = 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        budget.check("a JSON string", size)
        chunks.append(chunk)
    return "".join(chunks)


def _encoder(
    ensure_ascii: bool, indent: int | str | None, separators: tuple[str, str] | None, sort_keys: bool
) -> json.JSONEncoder:
    """A JSONEncoder for these options (encoders keep no state between calls). Options of the plain
    types are kept (templates pass constants); others get a one-off, so they fail as ``json.dumps``."""
    plain = (
        type(ensure_ascii) is bool
        and type(sort_keys) is bool
        and (indent is None or type(indent) is int or type(indent) is str)
        and (separators is None or (type(separators) is tuple and all(type(s) is str for s in separators)))
    )
    key = (ensure_ascii, indent, separators, sort_keys)
    encoder = _ENCODERS.get(key) if plain else None
    if encoder is None:
        encoder = json.JSONEncoder(
            ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        if plain and len(_ENCODERS) < _MAX_ENCODERS:
            _ENCODERS[key] = encoder
    return encoder


_ENCODERS: dict[tuple[Any, ...], json.JSONEncoder] = {}
_MAX_ENCODERS = 64  # templates pass constants; a template cannot grow this without bound


# --- filters (and lipsum): a tick, a check before the call where one is needed, the result admitted

FilterCheck = Callable[[Budget, dict[str, Any]], None]


def _center_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    width = arguments.get("width", 80)
    if is_int(width):
        budget.check("a padded string", width)


def _indent_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    width, text = arguments.get("width", 4), arguments.get("s")
    budget.indent(width)
    if isinstance(text, str):
        per_line = len(width) if isinstance(width, str) else width if is_int(width) else 0
        budget.check("an indented string", len(text) + (text.count("\n") + 1) * per_line)


def _wordwrap_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    text, width, wrap = arguments.get("s"), arguments.get("width", 79), arguments.get("wrapstring")
    if isinstance(text, str) and is_int(width) and width > 0:
        lines = len(text) // width + text.count("\n") + 1
        budget.check("a wrapped string", len(text) + lines * (len(wrap) if isinstance(wrap, str) else 1))


def _format_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    values = arguments.get("args") or arguments.get("kwargs")
    budget.printf(arguments.get("value"), tuple(values) if isinstance(values, tuple) else values)


def _join_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    value, separator = arguments.get("value"), arguments.get("d", "")
    if isinstance(value, str) or not isinstance(value, Iterable):
        return
    items = list(value)  # weighed whole (an attribute of an item weighs no more than the item)
    arguments["value"] = items
    budget.check(
        "a joined string", joined_size(budget, items, len(separator) if isinstance(separator, str) else 0)
    )


def _replace_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    count = arguments.get("count")
    size = replaced_size(
        arguments.get("s"), arguments.get("old"), arguments.get("new"), -1 if count is None else count
    )
    budget.check("a replaced string", size)


def _round_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    precision = arguments.get("precision", 0)
    if is_int(precision):
        budget.power(10, abs(precision))


def _lipsum(budget: Budget, arguments: dict[str, Any]) -> None:
    paragraphs, words = arguments.get("n", 5), arguments.get("max", 100)
    if is_int(paragraphs) and is_int(words):
        budget.count("lorem ipsum words", paragraphs * words)


FILTER_CHECKS: Mapping[str, FilterCheck] = {
    "center": _center_filter,
    "indent": _indent_filter,
    "wordwrap": _wordwrap_filter,
    "format": _format_filter,
    "join": _join_filter,
    "replace": _replace_filter,
    "round": _round_filter,
    "batch": lambda budget, arguments: budget.count("a batch of", arguments.get("linecount")),
    "slice": lambda budget, arguments: budget.count("slices:", arguments.get("slices")),
    "lipsum": _lipsum,
}


def _pass_arg(function: Callable[..., Any]) -> object:
    return getattr(function, "jinja_pass_arg", None)


def bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a filter, or the ``lipsum`` global) ticking, checked first, its result admitted.

    ``functools.wraps`` keeps Jinja's ``jinja_pass_arg`` marker, so the filter gets the same
    arguments; when the arguments do not bind, the check is skipped and the call raises as usual.
    """
    check = FILTER_CHECKS.get(name)
    signature = inspect.signature(function) if check is not None else None  # the wrapped function's
    # Jinja's async-variant wrappers take an eval context the wrapped function does not declare
    hidden = int(_pass_arg(function) is not None and _pass_arg(inspect.unwrap(function)) is None)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.tick()
        if check is not None and signature is not None:
            try:
                bound = signature.bind(*args[hidden:], **kwargs)
            except TypeError:
                bound = None
            if bound is not None:
                check(budget, bound.arguments)
                args, kwargs = (*args[:hidden], *bound.args), bound.kwargs
        return budget.admit(function(*args, **kwargs))

    return run
