"""Waiting on conditions and reading structlog lines in tests that run the code under test in-loop.

``capture_logs`` backs the ``logs`` fixture of conftest.py: every structlog line as a dict (loggers
are bound when the code under test is built, so the fixture must come first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import structlog
from structlog.testing import LogCapture

Logs = list[MutableMapping[str, Any]]
TIMEOUT_S = 30.0  # a deadline, not a wait: generous, for 2 slow cores shared with other work


async def until(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    """Poll a condition (the code under test runs in the same loop) until it holds or time is up."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)
    return value


def find(logs: Logs, event: str, **fields: Any) -> Logs:
    """The lines of ``event`` whose fields include ``fields``."""
    return [e for e in logs if e["event"] == event and all(e.get(k) == v for k, v in fields.items())]


def capture_logs() -> Iterator[Logs]:
    capture = LogCapture()
    old = structlog.get_config()
    structlog.configure(processors=[capture], cache_logger_on_first_use=False)
    try:
        yield capture.entries
    finally:
        structlog.configure(**old)
