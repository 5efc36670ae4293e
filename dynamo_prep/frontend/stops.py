"""Stop strings on streamed text, matched by an Aho-Corasick automaton in time linear in the text."""

from __future__ import annotations

import re
from collections.abc import Iterable

from dynamo_prep.threads import hand_over_gil, off_loop_thread

__all__ = ["StopMatcher"]

# Built in a thread (large stop lists), the automaton hands the GIL to the event loop this often.
_YIELD_EVERY_STATES = 1024


class StopMatcher:
    """One response's stop strings: ``push`` text as it streams, ``finish`` once it has ended.

    The answer is the one a naive scan of the held-back text for every stop string gives on each
    push: the stop string that starts earliest cuts the text where it starts (``stopped``); else the
    tail held back is the longest suffix that is a proper prefix of some stop string, and all text
    before it is released. A pushed character costs O(1) automaton steps (amortized), however many
    stop strings there are; building the automaton costs their total length. Empty stop strings
    are ignored.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        patterns = sorted({stop for stop in stops if stop})
        self._yielding = off_loop_thread()
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]  # length of the prefix a state stands for
        for pattern in patterns:
            self._insert(pattern)
            self._yield()
        self._fail = [0] * len(self._goto)
        # length of the longest stop string that ends a state's prefix (0: none)
        self._match = [0] * len(self._goto)
        for pattern in patterns:
            self._match[self._state_of(pattern)] = len(pattern)
        self._link()
        firsts = "".join(sorted(self._goto[0]))
        self._starts = re.compile(f"[{re.escape(firsts)}]") if firsts else None
        self._state = 0
        self._held = ""  # the text the current state stands for: never released yet
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """``(text released now, stopped)``; once stopped, every push is ``("", True)``."""
        if self.stopped:
            return "", True
        starts = self._starts
        if starts is None:
            return text, False
        held = self._held + text
        goto, fail, depth, match = self._goto, self._fail, self._depth, self._match
        state, position, end = self._state, len(self._held), len(held)
        cut = -1  # where the earliest complete stop string starts
        while position < end:
            if state == 0:  # skip to the next character that can start a stop string
                found = starts.search(held, position)
                if found is None:
                    position = end
                    break
                position = found.start()
            char = held[position]
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            position += 1
            if match[state] and (cut < 0 or position - match[state] < cut):
                cut = position - match[state]
            if 0 <= cut <= position - depth[state]:
                break  # every later match starts at or after where this state's prefix starts
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return held[:cut], True
        keep = depth[state]
        self._state = state
        self._held = held[end - keep :] if keep else ""
        return held[: end - keep], False

    def finish(self) -> str:
        """The held-back tail once the stream has ended (empty after a stop)."""
        held, self._held, self._state = self._held, "", 0
        return "" if self.stopped else held

    def _insert(self, pattern: str) -> None:
        state = 0
        for char in pattern:
            following = self._goto[state].get(char)
            if following is None:
                following = len(self._goto)
                self._goto[state][char] = following
                self._goto.append({})
                self._depth.append(self._depth[state] + 1)
            state = following

    def _yield(self) -> None:
        """Off the event loop's thread, let it take the GIL now (not after a switch interval)."""
        if self._yielding:
            hand_over_gil()

    def _state_of(self, pattern: str) -> int:
        state = 0
        for char in pattern:
            state = self._goto[state][char]
        return state

    def _link(self) -> None:
        """Failure links breadth first; a state's match is its own, else its failure state's."""
        goto, fail, match = self._goto, self._fail, self._match
        queue = list(goto[0].values())
        for walked, state in enumerate(queue):  # grows while it is walked: breadth-first order
            if not walked % _YIELD_EVERY_STATES:
                self._yield()
            for char, following in goto[state].items():
                back = fail[state]
                while back and char not in goto[back]:
                    back = fail[back]
                fail[following] = goto[back].get(char, 0)  # shallower than ``following``: never itself
                if not match[following]:
                    match[following] = match[fail[following]]
                queue.append(following)
