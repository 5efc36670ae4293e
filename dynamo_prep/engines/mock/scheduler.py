"""The mock engine's loop as a real engine's scheduler looks from outside: a bounded batch, a queue,
and a core that can hang.

At most ``slots`` requests generate at once (a real engine's ``max_num_seqs``); the others wait in
arrival order without a token, as in an engine's waiting queue. ``hold()`` stops every step until
``release()``: what a stopped or wedged engine core looks like to its worker, whose process,
heartbeats and request plane stay up (docs/request-plane.md, "Busy, hung and dead").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from dynamo_prep.engines.base import EngineOutput, GenerateFn
from dynamo_prep.protocol.preprocessed import PreprocessedRequest

__all__ = ["MockScheduler"]

log = structlog.get_logger("dynamo_prep.engines")


class MockScheduler:
    """Runs ``generate`` with at most ``slots`` requests at once (None: no bound), holdable."""

    def __init__(self, generate: GenerateFn, *, slots: int | None = None) -> None:
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._generate = generate
        self._slots = asyncio.Semaphore(slots) if slots is not None else None
        self._running = asyncio.Event()
        self._running.set()

    @property
    def held(self) -> bool:
        return not self._running.is_set()

    def hold(self) -> None:
        """Stop every step (a hung engine core) until ``release``."""
        self._running.clear()
        log.warning("mock_engine_held")

    def release(self) -> None:
        self._running.set()
        log.warning("mock_engine_released")

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """The request's steps once it has a slot; none while the engine is held."""
        async with self._slots if self._slots is not None else contextlib.nullcontext():
            await self._running.wait()
            steps = self._generate(request)
            try:
                async for step in steps:
                    await self._running.wait()
                    yield step
            finally:
                aclose = getattr(steps, "aclose", None)
                if aclose is not None:
                    await aclose()
