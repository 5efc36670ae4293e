"""What a chat template may cost: a deadline, the size of every value it builds, and its output.

A model's template comes from a worker, so it is input like any request. The limits and where
each is enforced are listed in docs/hostile-input.md. The rules the code relies on:

* Every render runs under one ``Budget`` (a context variable, so concurrent renders in threads
  are independent): a deadline checked every ``TICKS_PER_CLOCK_READ`` ticks, and a running total of the
  characters the template allocated. Loop iterations, calls and filters tick (anything else runs
  a bounded number of times between two of them), so a render stops within one bounded operation
  of its deadline.
* A value is checked BEFORE an operation that could allocate far more than its operands (``**``,
  ``*``, ``%`` and ``format`` widths; padding, ``replace``, ``join`` and the like in ``checks``): a
  single builtin call must never run long or huge, because a deadline cannot interrupt it.
* Every string and container a template builds is admitted: its length, or for a container its
  ``weight`` (an upper estimate of its printed size, shared references counted each time), must
  stay within ``max_chars``. So no container of many references to one big string can exist, and
  printing or serializing any value stays bounded.
* Compiling folds constants by calling filters; it runs under ``COMPILE_LIMITS``, whose small caps
  make a fold that would build a big constant fail, so it is evaluated at render time instead.
"""

from __future__ import annotations

import contextvars
import re
import string
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeGuard

import structlog

from dynamo_prep.logging import RateLimiter
from dynamo_prep.prompt import PromptRenderError
from dynamo_prep.threads import hand_over_gil, off_loop_thread

__all__ = [
    "COMPILE_LIMITS",
    "MAX_TEMPLATE_CHARS",
    "RENDER_LIMITS",
    "TICKS_PER_CLOCK_READ",
    "Budget",
    "RenderSliceSpent",
    "TemplateLimitError",
    "TemplateLimits",
    "bounded",
    "compiling",
    "current",
    "is_int",
    "log_limit",
    "sliced",
]

log = structlog.get_logger("dynamo_prep.formatter.jinja")

MAX_TEMPLATE_CHARS = 1 << 20  # template source; real chat templates are under 20,000 characters
TICKS_PER_CLOCK_READ = 16
# A render in a thread running longer than this (only hostile or huge ones do) hands the GIL over
# at each clock read, so the event loop is not kept waiting behind it (/live within 50 ms).
YIELD_AFTER_S = 0.005


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


class RenderSliceSpent(Exception):  # noqa: N818 (not an error: a signal to render elsewhere)
    """A render started under ``sliced(seconds)`` ran past its slice, not its deadline: the caller
    renders it again where it may take its whole budget (a thread, off the event loop)."""


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
        "slice_end",
        "ticks",
        "yield_after",
    )

    def __init__(self, limits: TemplateLimits, *, timed: bool = True) -> None:
        self.limits = limits
        self._timed = timed  # untimed: the shared budget outside renders, sizes only
        self._max_chars = limits.max_chars
        self._max_total = limits.max_total_chars if timed else float("inf")
        now = time.monotonic()
        self.deadline = now + limits.seconds if timed else float("inf")
        slice_s = _SLICE.get() if timed else None
        self.slice_end = now + slice_s if slice_s is not None else float("inf")
        # Off the main thread (the event loop's), a long render yields the GIL at every clock read.
        self.yield_after = now + YIELD_AFTER_S if timed and off_loop_thread() else float("inf")
        self.ticks = 0
        self.allocated = 0
        self.expired = False
        self._weights: dict[int, tuple[object, int]] = {}  # id -> (the container, kept alive; weight)

    def tick(self) -> None:
        self.ticks += 1
        if self.expired or not self.ticks % TICKS_PER_CLOCK_READ:
            self._read_clock()

    def tick_many(self, count: int) -> None:
        """``count`` ticks at once, the clock read now (a short loop's iterations, before they run)."""
        self.ticks += count
        self._read_clock()

    def _read_clock(self) -> None:
        now = time.monotonic()
        if self.expired or now > self.deadline:
            self.expired = True
            raise TemplateLimitError(
                "seconds", f"the chat template ran past its {self.limits.seconds:g} s deadline"
            )
        if now > self.slice_end:
            raise RenderSliceSpent("the render ran past its slice of the event loop")
        if now > self.yield_after:
            hand_over_gil()

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
        limit = self._max_chars
        total = 2
        if isinstance(value, dict):
            for key, item in value.items():  # a str (the common leaf) is inlined: len + 2, + 2
                total += len(key) + 4 if type(key) is str else self.weight(key) + 2
                if total > limit:
                    return total
                total += len(item) + 4 if type(item) is str else self.weight(item) + 2
                if total > limit:
                    return total
        else:
            for item in value:
                total += len(item) + 4 if type(item) is str else self.weight(item) + 2
                if total > limit:
                    return total
        if self._timed:
            self._weights[id(value)] = (value, total)
        return total

    def power(self, base: Any, exponent: Any) -> None:
        if is_int(base) and is_int(exponent) and exponent > 0 and abs(base) > 1:
            self._bits(base.bit_length() * exponent)

    def product(self, left: Any, right: Any) -> None:
        if is_int(left) and is_int(right):
            self._bits(left.bit_length() + right.bit_length())
            return
        sequence, times = (left, right) if is_int(right) else (right, left)
        if is_int(times) and times > 0 and isinstance(sequence, str | list | tuple):
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
        width = len(indent) if isinstance(indent, str) else indent if is_int(indent) else 0
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


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FORMATTER = string.Formatter()
_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("jinja_budget", default=None)
_SLICE: contextvars.ContextVar[float | None] = contextvars.ContextVar("jinja_render_slice", default=None)
_UNTIMED = Budget(RENDER_LIMITS, timed=False)


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int)


def _int_sum(values: Iterable[Any]) -> int:
    return sum(abs(value) for value in values if isinstance(value, int))


def current() -> Budget:
    """The active render's budget; outside any render (a template rendered directly), sizes only."""
    return _BUDGET.get() or _UNTIMED


@contextmanager
def sliced(seconds: float) -> Iterator[None]:
    """Renders started inside raise ``RenderSliceSpent`` once they have run ``seconds`` (the event
    loop's share); every limit is otherwise unchanged. Context-local: a thread started inside
    (``asyncio.to_thread`` copies the context) inherits the slice."""
    token = _SLICE.set(seconds)
    try:
        yield
    finally:
        _SLICE.reset(token)


def bounded(limits: TemplateLimits) -> AbstractContextManager[Budget]:
    """A render's budget; nested calls share the outer one (a traced render is part of its request)."""
    active = _BUDGET.get()
    return nullcontext(active) if active is not None else _Activated(Budget(limits))


def compiling() -> AbstractContextManager[Budget]:
    """A fresh budget for one compile: the constant folding it does is small and timed."""
    return _Activated(Budget(COMPILE_LIMITS))


class _Activated(AbstractContextManager[Budget]):
    """``budget`` active inside the block (a class: a generator-based manager costs a render 1 us)."""

    __slots__ = ("_budget", "_token")

    def __init__(self, budget: Budget) -> None:
        self._budget = budget

    def __enter__(self) -> Budget:
        self._token = _BUDGET.set(self._budget)
        return self._budget

    def __exit__(self, *exc_info: object) -> None:
        _BUDGET.reset(self._token)


_LIMITER = RateLimiter(interval_s=10.0)


def log_limit(exc: TemplateLimitError) -> None:
    """One warning per limit per 10 s: a hostile template trips on every request."""
    suppressed = _LIMITER.allow(exc.limit, time.monotonic())
    if suppressed is not None:
        log.warning("chat_template_limit_exceeded", limit=exc.limit, error=str(exc), suppressed=suppressed)
