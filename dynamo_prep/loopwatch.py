"""Notice when a process's event loop stalls, and say whose the stall was: the loop's or the host's.

A timer asks to run every ``interval_s``; when it runs more than ``threshold_s`` late the loop was
held up, and the loop thread's own scheduler counters (``/proc/thread-self/schedstat``: time on a
CPU, time runnable and waiting for one) say why: ``ran_ms`` is time the thread was on a CPU (our
own code held the loop: a slow callback), ``waited_ms`` time it was runnable and got no CPU (the
host's: other processes held the cores). Each stall is one ``event_loop_stalled`` warning (at most
one a second; docs/operations.md).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from dynamo_prep.logging import RateLimiter

__all__ = ["STALL_THRESHOLD_S", "LoopWatch", "Stall"]

log = structlog.get_logger("dynamo_prep.loop")

# A loop whose timer fires this much later than asked was stalled (issue 28's bound for a frontend).
STALL_THRESHOLD_S = 0.1
WATCH_INTERVAL_S = 0.05
_SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True, slots=True)
class Stall:
    """One stall: how long past its time the timer ran, and the loop thread's share of it."""

    stalled_s: float
    ran_s: float | None  # on a CPU meanwhile (None: the host does not say)
    waited_s: float | None  # runnable, without a CPU, meanwhile

    @property
    def cause(self) -> str:
        """``host`` when the thread mostly waited for a CPU, ``loop`` when it mostly ran, else
        ``stopped`` (neither: the process was stopped, or the host says nothing)."""
        if self.ran_s is None or self.waited_s is None:
            return "unknown"
        if max(self.ran_s, self.waited_s) < self.stalled_s / 2:
            return "stopped"
        return "host" if self.waited_s >= self.ran_s else "loop"


class LoopWatch:
    """Started on the loop it watches (``start``), stopped with ``stop``; ``on_stall`` is told of
    each stall (a metric), ``stalls`` counts them."""

    def __init__(
        self,
        *,
        threshold_s: float = STALL_THRESHOLD_S,
        interval_s: float = WATCH_INTERVAL_S,
        on_stall: Callable[[Stall], None] | None = None,
    ) -> None:
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.stalls = 0
        self.longest_s = 0.0
        self._on_stall = on_stall
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._counters: tuple[int, int] | None = None
        self._fd: int | None = None
        self._log = RateLimiter()

    def start(self) -> None:
        try:
            self._fd = os.open(_SCHEDSTAT, os.O_RDONLY)  # the loop's thread: this is called on it
        except OSError:
            self._fd = None
        self._counters = self._read()
        self._arm()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _arm(self) -> None:
        self._due = time.monotonic() + self.interval_s
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        late = time.monotonic() - self._due
        counters = self._read()
        if late > self.threshold_s:
            self._stalled(late, counters)
        self._counters = counters
        self._arm()

    def _stalled(self, late: float, counters: tuple[int, int] | None) -> None:
        before = self._counters
        ran = waited = None
        if counters is not None and before is not None:
            ran, waited = (counters[0] - before[0]) / 1e9, (counters[1] - before[1]) / 1e9
        stall = Stall(late, ran, waited)
        self.stalls += 1
        self.longest_s = max(self.longest_s, late)
        if self._on_stall is not None:
            self._on_stall(stall)
        suppressed = self._log.allow("stall", time.monotonic())
        if suppressed is not None:
            log.warning(
                "event_loop_stalled",
                stalled_ms=round(late * 1000, 1),
                ran_ms=None if ran is None else round(ran * 1000, 1),
                waited_ms=None if waited is None else round(waited * 1000, 1),
                cause=stall.cause,
                suppressed=suppressed,
            )

    def _read(self) -> tuple[int, int] | None:
        """(ns on a CPU, ns runnable without one) of the loop's thread, or None."""
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):
            return None
