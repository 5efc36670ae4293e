"""structlog set-up: configured once at process start, JSON lines for ops to tail."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Any, Literal, TextIO

import structlog

LogFormat = Literal["json", "console"]
# The longest peer- or client-supplied text (an error, a detail) a log line carries.
DETAIL_CHARS = 300
_configured: dict[str, Any] | None = None


def configure_logging(
    *, level: str = "info", log_format: LogFormat = "json", stream: TextIO | None = None, **context: Any
) -> None:
    """One event per line (JSON by default) with ISO time, level, event and bound context.

    Idempotent per process: the first call wins. ``context`` (e.g. ``component="frontend"``) is
    bound to every log line of the process.
    """
    global _configured  # noqa: PLW0603 - process-wide, set exactly once
    if _configured is not None:
        return
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        # One write per line (message and newline together): cheaper than print, and lines from
        # several processes sharing stdout (--http-workers) never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stdout),
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging(stream or sys.stdout, numeric_level, shared, renderer)
    structlog.contextvars.bind_contextvars(**context)
    _configured = {"level": level, "log_format": log_format, **context}


def logging_options() -> dict[str, Any]:
    """How this process configured its logging (``configure_logging``'s keywords but the stream),
    so a child process it starts can log the same way; empty when it never did."""
    return dict(_configured or {})


def _route_stdlib_logging(stream: TextIO, level: int, shared: list[Any], renderer: Any) -> None:
    """Libraries' stdlib log records (uvicorn, asyncio) become the same JSON lines as ours."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    # asyncio warns about sends to peers that already hung up (client disconnects): noise for ops.
    logging.getLogger("asyncio").setLevel(logging.ERROR)


class RateLimiter:
    """At most one line per key per interval; reports how many were suppressed in between."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def allow(self, key: str, now: float) -> int | None:
        """None: stay quiet. Else the number of lines suppressed since the last one for ``key``."""
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)
