"""The planes' clock: absolute times on the wire (``sent_ms``, ``deadline_ms``) are milliseconds
since the epoch, comparable between hosts."""

from __future__ import annotations

import time

__all__ = ["now_ms"]


def now_ms() -> int:
    return time.time_ns() // 1_000_000
