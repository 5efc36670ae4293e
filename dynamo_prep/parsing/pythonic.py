"""Pythonic tool calls (``pythonic``: Llama 3.2, ToolACE; ``llama4_pythonic``: Llama 4): the answer
is ``[name(key=value, ...), ...]``, values Python literals, or text.

The list opens the answer (after whitespace at most; Llama 4: or follows ``<|python_start|>``
anywhere, and ``<|python_end|>`` may close it). Each call is read as it streams (strings, escapes
and brackets tracked) and released once its parentheses close, its arguments as a JSON object;
what is no call, and whatever follows it, is content. Grammar, recoveries and how this differs from
vLLM's parsers: docs/answers.md ("Pythonic").
"""

from __future__ import annotations

import re
from typing import Final

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._python import OPEN, REFUSED, ArgumentsEnd, NotACallError, parse_call
from dynamo_prep.parsing._recoveries import Recoveries

__all__ = ["PYTHON_END", "PYTHON_START", "Llama4PythonicTools", "PythonicTools"]

PYTHON_START: Final = "<|python_start|>"
PYTHON_END: Final = "<|python_end|>"

# Where the half stands: before the list (the answer's start, after a python tag), in the list
# before a call, in a call's name, in its arguments, after a call, after the list, in text.
_START, _LIST, _NAME, _ARGUMENTS, _AFTER_CALL, _AFTER_LIST, _TEXT = range(7)
_HELD = (_LIST, _NAME, _ARGUMENTS, _AFTER_CALL)  # inside a list: what is held may still be calls
_BLANK = re.compile(r"[ \t\f\r\n]*")
_NAME_PIECE = re.compile(r"\w+|[ \t\f\r\n]+|\.")
_NAME_START = re.compile(r"[^\W\d]")


class PythonicTools(ToolHalf):
    """Content and a ``[call, ...]`` list of calls, each released when its parentheses close."""

    NEEDS_TOOLS = True  # a list in an answer may be code: calls are read only when tools are declared

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._state = _START
        self._held = bytearray()  # what may still be calls (UTF-8): since the list opened or the last call
        self._call_at = 0  # where in it the call being read starts
        self._arguments = ArgumentsEnd()
        self._tagged = False  # a python tag opened this stretch
        self._stretch = 0  # calls released in this stretch
        self._comma = False  # in the list after a comma (not right after "[")
        self._gap = False  # in a name: whitespace after a word, so only "." or "(" may follow
        self._dot = False  # in a name: after a "."

    def _looking_for(self) -> tuple[str, ...]:
        return () if self._state == _ARGUMENTS else self.MARKERS

    def _on_text(self, text: str, out: DeltaList) -> None:
        at, size = 0, len(text)
        while at < size:
            state = self._state
            if state == _TEXT:
                out.content(text[at:] if at else text)
                return
            if state == _ARGUMENTS:
                at = self._read_arguments(text, at, out)
            elif state == _NAME:
                at = self._read_name(text, at, out)
            else:
                at = self._read_between(text, at, out)

    def _read_between(self, text: str, at: int, out: DeltaList) -> int:
        """Whitespace is held; then the one character the state accepts moves on, anything else ends
        the calls (counted when it was meant as a call)."""
        end = _BLANK.match(text, at).end()  # type: ignore[union-attr]
        self._hold(text[at:end])
        if end == len(text):
            return end
        char, state = text[end], self._state
        if state == _START and char == "[":
            self._state, self._comma = _LIST, False
        elif state == _LIST and _NAME_START.match(char):
            self._state, self._call_at, self._gap, self._dot = _NAME, len(self._held), False, False
            return end  # the name is read from its first character
        elif state == _LIST and char == "]" and self._comma and self._stretch:
            self._state = _AFTER_LIST  # a trailing comma
        elif state == _AFTER_CALL and char in ",]":
            self._state, self._comma = (_LIST, True) if char == "," else (_AFTER_LIST, False)
        else:
            self._no_call(out, meant=state != _AFTER_LIST and self._meant())
            return end
        if self._state == _AFTER_LIST:
            self._held.clear()
        else:
            self._hold(char)
        return end + 1

    def _read_name(self, text: str, at: int, out: DeltaList) -> int:
        """A dotted name, then ``(``: words, dots and whitespace (a word after whitespace only after a
        dot); anything else is no call."""
        size = len(text)
        while at < size:
            piece = _NAME_PIECE.match(text, at)
            if piece is None:
                if text[at] != "(":
                    self._no_call(out, meant=self._meant())
                    return at
                self._hold("(")
                self._state, self._arguments = _ARGUMENTS, ArgumentsEnd()
                return at + 1
            word = piece.group()
            if word == ".":
                self._dot, self._gap = True, False
            elif word[0].isspace():
                self._gap = True
            elif self._gap and not self._dot:
                self._no_call(out, meant=self._meant())
                return at
            else:
                self._dot = self._gap = False
            self._hold(word)
            at = piece.end()
        return at

    def _read_arguments(self, text: str, at: int, out: DeltaList) -> int:
        end = self._arguments.feed(text, at)
        if end == OPEN:
            self._hold(text[at:] if at else text)
            return len(text)
        if end == REFUSED:
            self._no_call(out, meant=True)
            return at
        self._hold(text[at:end])
        try:
            call = parse_call(self._held[self._call_at :].decode())
        except NotACallError:
            self._no_call(out, meant=True)
            return end
        for _ in range(call.repeated):
            self._recoveries.add(kinds.DUPLICATE_ARGUMENT)
        self._held.clear()
        self._state = _AFTER_CALL
        self._stretch += 1
        self._call(call.name, call.arguments, out)
        return end

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        """Llama 4's tags: ``<|python_start|>`` opens a list wherever it stands (a list it interrupts
        ends there); ``<|python_end|>`` closes one (with no python block open it is dropped, counted)."""
        state = self._state
        if state in _HELD:
            self._end_list(out)
        elif marker == PYTHON_END and state == _START and not self._tagged:
            self._no_call(out, meant=False)  # whitespace before a stray end tag
        if marker == PYTHON_START:
            self._held.clear()  # whitespace before it
            self._state, self._tagged, self._stretch = _START, True, 0
            return
        if state == _START and self._tagged:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)  # an empty python block
        elif state not in _HELD and not self._tagged:
            self._recoveries.add(kinds.UNKNOWN_TAG)  # no python block to close
        self._held.clear()
        self._state, self._tagged = _TEXT, False

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        if cut:  # a call cut by max_tokens is never half sent
            self._held.clear()
        elif self._state in _HELD:
            self._end_list(out)  # the model ended inside the list
        elif self._state == _START:
            if self._tagged and not self._stretch:
                self._recoveries.add(kinds.INVALID_TOOL_CALL)  # a python tag and no list
            elif not self._tagged:
                self._no_call(out, meant=False)  # an answer of whitespace only
        self._held.clear()
        self._state = _TEXT

    # -- helpers -----------------------------------------------------------------------------------

    def _hold(self, text: str) -> None:
        if text:
            self._held += text.encode()

    def _meant(self) -> bool:
        """A python tag or a call came before, or a call's arguments opened: meant as calls."""
        return self._tagged or self._stretch > 0 or self._state == _ARGUMENTS

    def _end_list(self, out: DeltaList) -> None:
        """The list ends without its ``]``: right after whole calls, they stand (``unclosed_call``);
        else what is held is content (counted when it was meant as a call)."""
        if self._state in (_LIST, _AFTER_CALL) and self._stretch and not self._held.strip(b" \t\f\r\n,"):
            self._recoveries.add(kinds.UNCLOSED_CALL)
            self._held.clear()
            self._state = _TEXT
        else:
            self._no_call(out, meant=self._meant())

    def _no_call(self, out: DeltaList, *, meant: bool) -> None:
        """The calls end: what was held is content, and so is all that follows (but a python tag)."""
        if meant:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
        if held := self._held.decode():
            out.content(held)
        self._held.clear()
        self._state = _TEXT


class Llama4PythonicTools(PythonicTools):
    """``pythonic`` with Llama 4's optional ``<|python_start|>`` ... ``<|python_end|>`` around the list."""

    MARKERS = (PYTHON_START, PYTHON_END)
    OPENERS = (PYTHON_START,)
