"""The one place where msgspec's decode failures become the project's typed errors.

Every edge that decodes peer or client bytes (or converts a client's dict) uses ``decoding``, so
each failure has one of three stable reasons: ``invalid`` (well-formed, wrong shape or value),
``undecodable`` (not MessagePack/JSON at all) and ``too_deep`` (nesting past the decoder's
recursion limit, which Python raises as ``RecursionError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import msgspec

__all__ = ["WireDecodeError", "decoding"]


class WireDecodeError(ValueError):
    """Bytes that cannot be used; ``reason`` is a stable snake_case label for metrics and logs."""

    def __init__(self, reason: str, detail: str, *, message: str | None = None) -> None:
        super().__init__(message or f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@contextlib.contextmanager
def decoding(error: Callable[[str, str], Exception] = WireDecodeError) -> Iterator[None]:
    """Inside, a msgspec failure (or a too-deep payload) raises ``error(reason, detail)``."""
    try:
        yield
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: it goes first
        raise error("invalid", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise error("undecodable", str(exc)) from exc
    except RecursionError as exc:
        raise error("too_deep", "nested too deeply") from exc
