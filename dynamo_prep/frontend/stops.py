"""Stop strings on streamed text: release what can no longer start one, cut at the first match."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """``push`` text as it streams; the earliest stop string cuts the text where it starts.

    The tail that could still grow into a stop string is held back until the next text proves it
    does not (the longest suffix that is a proper prefix of some stop string).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """(the text released now, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        held = self._held + text
        cut = min((held.find(stop) for stop in self._stops if stop in held), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return held[:cut], True
        keep = max((_overlap(held, stop) for stop in self._stops), default=0)
        released, self._held = held[: len(held) - keep], held[len(held) - keep :]
        return released, False

    def finish(self) -> str:
        """What is still held back once the stream has ended."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
