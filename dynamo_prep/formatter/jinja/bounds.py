"""What a chat template may cost: a deadline, the size of every value it builds, and its output.

A model's template comes from a worker, so it is input like any request. The limits and where
each is enforced are listed in docs/hostile-input.md. The rules the code relies on:

* Every render runs under one ``Budget`` (a context variable, so concurrent renders in threads
  are independent): a deadline checked every ``_TICKS`` ticks, and a running total of the
  characters the template allocated. Loop iterations, calls, filters, intercepted operators and
  output chunks tick, so a render stops within one bounded operation of its deadline.
* A value is checked BEFORE an operation that could allocate far more than its operands (``**``,
  ``*``, ``%`` and ``format`` widths, padding, ``replace``, ``join``): a single builtin call must
  never run long or huge, because a deadline cannot interrupt it.
* Every string and container a template builds is admitted: its length, or for a container its
  ``weight`` (an upper estimate of its printed size, shared references counted each time), must
  stay within ``max_chars``. So no container of many references to one big string can exist, and
  printing or serializing any value stays bounded.
* Compiling folds constants by calling filters; it runs under ``COMPILE_LIMITS``, whose small caps
  make a fold that would build a big constant fail, so it is evaluated at render time instead.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeGuard

import structlog

from dynamo_prep.logging import RateLimiter
from dynamo_prep.prompt import PromptRenderError

__all__ = [
    "COMPILE_LIMITS",
    "MAX_TEMPLATE_CHARS",
    "RENDER_LIMITS",
    "Budget",
    "TemplateLimitError",
    "TemplateLimits",
    "bounded",
    "bounded_filter",
    "bounded_json",
    "compiling",
    "current",
    "log_limit",
]

log = structlog.get_logger("dynamo_prep.formatter.jinja")

MAX_TEMPLATE_CHARS = 1 << 20  # template source; real chat templates are under 20,000 characters
_TICKS = 16  # ticks between two clock reads


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """What one render (or one compile's constant folding) may cost."""

    seconds: float = 2.0
    max_chars: int = 1 << 23  # any one string, container weight, or the output
    max_total_chars: int = 1 << 25  # all characters the template allocates in one render
    max_int_bits: int = 1 << 15  # results of ``**`` and ``*`` on integers
    max_count: int = 100_000  # counts passed to batch, slice, lipsum (Jinja's own range cap)
    max_indent: int = 64  # characters of one indent level (tojson, indent)


RENDER_LIMITS = TemplateLimits()
COMPILE_LIMITS = TemplateLimits(seconds=10.0, max_chars=1 << 16, max_total_chars=1 << 20)


class TemplateLimitError(PromptRenderError):
    """A template went over a limit; ``limit`` names it (a ``TemplateLimits`` field)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class Budget:
    """One render's deadline and allocation total, and the weights of the containers it has seen."""

    __slots__ = (
        "_max_chars",
        "_max_total",
        "_timed",
        "_weights",
        "allocated",
        "deadline",
        "expired",
        "limits",
        "ticks",
    )

    def __init__(self, limits: TemplateLimits, *, timed: bool = True) -> None:
        self.limits = limits
        self._timed = timed  # untimed: the shared budget outside renders, sizes only
        self._max_chars = limits.max_chars
        self._max_total = limits.max_total_chars if timed else float("inf")
        self.deadline = time.monotonic() + limits.seconds if timed else float("inf")
        self.ticks = 0
        self.allocated = 0
        self.expired = False
        self._weights: dict[int, tuple[object, int]] = {}  # id -> (the container, kept alive; weight)

    def tick(self) -> None:
        self.ticks += 1
        if self.expired or (not self.ticks % _TICKS and time.monotonic() > self.deadline):
            self.expired = True
            raise TemplateLimitError(
                "seconds", f"the chat template ran past its {self.limits.seconds:g} s deadline"
            )

    def check(self, what: str, chars: int) -> None:
        """Refuse to build ``what`` of ``chars`` characters when that is over ``max_chars``."""
        if chars > self.limits.max_chars:
            raise TemplateLimitError(
                "max_chars",
                f"the chat template would build {what} {chars:,} characters long "
                f"(the limit is {self.limits.max_chars:,})",
            )

    def charge(self, chars: int) -> None:
        self.allocated += chars
        if self.allocated > self._max_total:
            raise TemplateLimitError(
                "max_total_chars",
                f"the chat template allocated {self.allocated:,} characters in one render "
                f"(the limit is {self.limits.max_total_chars:,})",
            )

    def count(self, what: str, value: object) -> None:
        if isinstance(value, int) and abs(value) > self.limits.max_count:
            raise TemplateLimitError(
                "max_count",
                f"the chat template asked for {what} {value:,} (the limit is {self.limits.max_count:,})",
            )

    def admit(self, value: Any) -> Any:
        """``value`` if it is within the limits (charged to the total), else a ``TemplateLimitError``."""
        if isinstance(value, str):  # the hot path: strings built by +, ~ and filters
            size = len(value)
            if size > self._max_chars:
                self.check("a string", size)
            self.allocated += size
            if self.allocated > self._max_total:
                self.charge(0)
        elif isinstance(value, list | tuple | dict | set | frozenset):
            self.check("a container (as printed)", self.weight(value))
            self.charge(len(value))
        elif type(value) is int:
            self._bits(value.bit_length())
        return value

    def weight(self, value: Any) -> int:
        """An upper estimate of ``str(value)``'s length (``tojson``'s, escapes aside); containers are
        weighed once per render, and a walk stops as soon as it is over ``max_chars``."""
        if isinstance(value, str):
            return len(value) + 2
        if not isinstance(value, list | tuple | dict | set | frozenset):
            return value.bit_length() // 3 + 2 if type(value) is int else 8
        known = self._weights.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        limit = self.limits.max_chars
        total = 2
        items: Iterable[Any] = value if not isinstance(value, dict) else (i for p in value.items() for i in p)
        for item in items:
            total += self.weight(item) + 2
            if total > limit:
                return total
        if self._timed:
            self._weights[id(value)] = (value, total)
        return total

    def power(self, base: Any, exponent: Any) -> None:
        if _is_int(base) and _is_int(exponent) and exponent > 0 and abs(base) > 1:
            self._bits(base.bit_length() * exponent)

    def product(self, left: Any, right: Any) -> None:
        if _is_int(left) and _is_int(right):
            self._bits(left.bit_length() + right.bit_length())
            return
        sequence, times = (left, right) if _is_int(right) else (right, left)
        if _is_int(times) and times > 0 and isinstance(sequence, str | list | tuple):
            size = len(sequence) if isinstance(sequence, str) else self.weight(sequence)
            self.check("a repetition", size * times)

    def printf(self, template: Any, values: Any) -> None:
        """``template % values`` (and the ``format`` filter): the widths it asks for, summed."""
        if not isinstance(template, str):
            return
        widths = 0
        for spec in _PRINTF_SPEC.finditer(template):
            for number in spec.groups():
                if number == "*":
                    widths += _int_sum(values if isinstance(values, tuple | list) else (values,))
                elif number:
                    widths += int(number)
        self.check("a formatted string", len(template) + widths)

    def format_widths(self, template: str, args: Iterable[Any], kwargs: Mapping[str, Any]) -> None:
        """``str.format``: the widths in its format specs (nested ones: every integer argument)."""
        widths = 0
        try:
            fields = list(_FORMATTER.parse(template))
        except ValueError:
            return  # the call raises the same error itself
        for _, _, spec, _ in fields:
            if spec:
                widths += sum(int(number) for number in re.findall(r"\d+", spec))
                if "{" in spec:
                    widths += _int_sum([*args, *kwargs.values()])
        self.check("a formatted string", len(template) + widths)

    def indent(self, indent: Any) -> None:
        """One indent level (a width or a string) within ``max_indent``: lines repeat it per level."""
        width = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
        if width > self.limits.max_indent:
            raise TemplateLimitError(
                "max_indent",
                f"the chat template asked for an indent of {width:,} (the limit is {self.limits.max_indent})",
            )

    def _bits(self, bits: int) -> None:
        if bits > self.limits.max_int_bits:
            raise TemplateLimitError(
                "max_int_bits",
                f"the chat template would compute an integer of about {bits:,} bits "
                f"(the limit is {self.limits.max_int_bits:,})",
            )


_JSON_ESCAPE_GROWTH = 12  # the most one character grows in JSON: an astral one as two \\uXXXX escapes
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FORMATTER = string.Formatter()
_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("jinja_budget", default=None)
_UNTIMED = Budget(RENDER_LIMITS, timed=False)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int)


def _int_sum(values: Iterable[Any]) -> int:
    return sum(abs(value) for value in values if isinstance(value, int))


def current() -> Budget:
    """The active render's budget; outside any render (a template rendered directly), sizes only."""
    return _BUDGET.get() or _UNTIMED


@contextmanager
def bounded(limits: TemplateLimits) -> Iterator[Budget]:
    """A render's budget; nested calls share the outer one (a traced render is part of its request)."""
    active = _BUDGET.get()
    if active is not None:
        yield active
        return
    budget = Budget(limits)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


@contextmanager
def compiling() -> Iterator[Budget]:
    """A fresh budget for one compile: the constant folding it does is small and timed."""
    budget = Budget(COMPILE_LIMITS)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


_LIMITER = RateLimiter(interval_s=10.0)


def log_limit(exc: TemplateLimitError) -> None:
    """One warning per limit per 10 s: a hostile template trips on every request."""
    suppressed = _LIMITER.allow(exc.limit, time.monotonic())
    if suppressed is not None:
        log.warning("chat_template_limit_exceeded", limit=exc.limit, error=str(exc), suppressed=suppressed)


# --- operations with a check before them ------------------------------------------------------

Check = Callable[[Budget, Any, tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]


def _width_method(
    budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    width = args[0] if args else kwargs.get("width")
    if _is_int(width):
        budget.check("a padded string", width)
    return args


def _expandtabs(budget: Budget, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    size = args[0] if args else kwargs.get("tabsize", 8)
    if _is_int(size):
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
    if _is_int(count) and count >= 0:
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
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    if indent is None and budget.weight(value) * _JSON_ESCAPE_GROWTH <= budget.limits.max_chars:
        return encoder.encode(value)  # one shot in C: at most this long
    chunks: list[str] = []
    size = 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        budget.check("a JSON string", size)
        chunks.append(chunk)
    return "".join(chunks)


# --- filters (and lipsum): a tick, a check before the call where one is needed, the result admitted

FilterCheck = Callable[[Budget, dict[str, Any]], None]


def _center_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    width = arguments.get("width", 80)
    if _is_int(width):
        budget.check("a padded string", width)


def _indent_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    width, text = arguments.get("width", 4), arguments.get("s")
    budget.indent(width)
    if isinstance(text, str):
        per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
        budget.check("an indented string", len(text) + (text.count("\n") + 1) * per_line)


def _wordwrap_filter(budget: Budget, arguments: dict[str, Any]) -> None:
    text, width, wrap = arguments.get("s"), arguments.get("width", 79), arguments.get("wrapstring")
    if isinstance(text, str) and _is_int(width) and width > 0:
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
    if _is_int(precision):
        budget.power(10, abs(precision))


def _lipsum(budget: Budget, arguments: dict[str, Any]) -> None:
    paragraphs, words = arguments.get("n", 5), arguments.get("max", 100)
    if _is_int(paragraphs) and _is_int(words):
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
