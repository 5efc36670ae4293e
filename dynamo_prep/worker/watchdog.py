"""The worker's engine watchdog: unfinished requests and no engine step for a while is a hung engine.

A hung engine core (stopped, deadlocked, wedged in one step) keeps its worker's process, heartbeats
and request plane alive: frontends would wait on its streams until their deadlines. The watchdog
reads the generation server's own clock (``GenerationServer.stalled_s``: how long the engine has
had work without a step) and reports the engine stalled past ``stall_timeout_s``; the worker then
withdraws, fails its requests over with a retryable 503 and exits (docs/request-plane.md, "Busy,
hung and dead"). A watchdog that itself woke late (this process was stopped or starved, not only
its engine) starts its observation again, so a frozen worker is not mistaken for a hung engine.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from dynamo_prep.worker.generate import GenerationServer

__all__ = ["EngineWatchdog"]

log = structlog.get_logger("dynamo_prep.worker")

# How often the watchdog looks, at most (it looks four times per stall timeout when that is shorter).
MAX_CHECK_S = 1.0
# A wake this much later than planned means the whole process was held, not only its engine.
LATE_WAKE_S = 0.5


class EngineWatchdog:
    """Watches one ``GenerationServer``; ``stalled()`` returns once its engine is hung."""

    def __init__(self, generation: GenerationServer, stall_timeout_s: float) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"the engine stall timeout must be positive, got {stall_timeout_s}")
        self.generation = generation
        self.stall_timeout_s = stall_timeout_s
        self._check_s = min(stall_timeout_s / 4, MAX_CHECK_S)

    async def stalled(self) -> str:
        """Return (a reason) when the engine has had work and made no step for ``stall_timeout_s``
        of this process's own waking time; never while it steps, or has nothing to do."""
        watching_since = time.monotonic()
        while True:
            planned = time.monotonic() + self._check_s
            await asyncio.sleep(self._check_s)
            now = time.monotonic()
            if now - planned > LATE_WAKE_S:
                watching_since = now  # the process itself was held: judge the engine from now on
                continue
            stalled_s = min(self.generation.stalled_s(), now - watching_since)
            if stalled_s >= self.stall_timeout_s:
                load = self.generation.load()
                log.error(
                    "engine_stalled",
                    stalled_s=round(stalled_s, 3),
                    stall_timeout_s=self.stall_timeout_s,
                    in_flight=load.unfinished,
                    waiting=load.waiting,
                )
                return "engine_stalled"
