"""Llama 3.1/3.2 JSON tool calls (``llama3_json``, ``llama4_json``): the answer is
``[<|python_tag|>] {"name": N, "parameters": {...}} [; {...}]*``, or text.

The calls open the answer (after whitespace at most), or follow ``<|python_tag|>`` anywhere. Each
object is read whole (strings and brackets tracked as it streams) and released as a call once it
closes. An object that is no call, and whatever follows it, is content. Grammar, recoveries and how
this differs from vLLM's parser: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._calls import ObjectEnd, json_call
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries

__all__ = ["PYTHON_TAG", "Llama3JsonTools"]

PYTHON_TAG: Final = "<|python_tag|>"
SEPARATOR: Final = ";"

# Where the half stands: text (no call can start but after a python tag), before a call (at the
# start of the answer, after a python tag, after a call), inside a call's object.
_TEXT, _BEFORE, _OBJECT = range(3)


class Llama3JsonTools(ToolHalf):
    """Content and ``{"name", "parameters"}`` calls, ``;``-separated (whitespace alone separates too)."""

    MARKERS = (PYTHON_TAG,)
    OPENERS = (PYTHON_TAG,)
    NEEDS_TOOLS = True  # an answer in JSON is no call: parsed only when the request declares tools

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._state = _BEFORE
        self._lead = bytearray()  # what stood before the object (whitespace, a separator), UTF-8
        self._body = bytearray()  # the object being read, UTF-8 (kept compact: it may be long)
        self._object_end = ObjectEnd()
        self._tagged = False  # a python tag opened this stretch of calls
        self._stretch = 0  # calls in this stretch
        self._separated = False  # a separator since the last call

    def _looking_for(self) -> tuple[str, ...]:
        return () if self._state == _OBJECT else self.MARKERS

    def _on_text(self, text: str, out: DeltaList) -> None:
        at = 0
        while at < len(text):
            if self._state == _TEXT:
                out.content(text[at:])
                return
            if self._state == _OBJECT:
                at = self._read_object(text, at, out)
            else:
                at = self._read_before(text, at, out)

    def _read_before(self, text: str, at: int, out: DeltaList) -> int:
        """Whitespace (and after a call one separator) is held; ``{`` opens an object; anything else
        ends the calls: what was held and the rest are content."""
        size = len(text)
        start = at
        while at < size and (text[at].isspace() or (text[at] == SEPARATOR and self._may_separate())):
            self._separated = self._separated or text[at] == SEPARATOR
            at += 1
        if at > start:
            self._lead += text[start:at].encode()
        if at == size:
            return at
        if text[at] == "{":
            self._state, self._object_end = _OBJECT, ObjectEnd()
            return at
        if self._tagged and not self._stretch:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)  # a python tag followed by no JSON call
        self._to_text(out)
        return at

    def _read_object(self, text: str, at: int, out: DeltaList) -> int:
        end = self._object_end.feed(text, at)
        if end < 0:
            self._body += text[at:].encode()
            return len(text)
        self._body += text[at:end].encode()
        self._end_object(out)
        return end

    def _end_object(self, out: DeltaList) -> None:
        body = self._body.decode()
        parsed = json_call(body, arguments_required=True)
        if parsed is None:
            if self._looks_like_call(body):
                self._recoveries.add(kinds.INVALID_TOOL_CALL)
            self._to_text(out)
            return
        self._body.clear()
        self._lead.clear()
        self._state, self._separated = _BEFORE, False
        self._stretch += 1
        self._call(*parsed, out)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        """A python tag opens calls wherever it stands; an object it interrupts is content."""
        if self._state == _OBJECT:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            self._to_text(out)
        elif self._state == _BEFORE:
            self._lead.clear()
        self._state, self._tagged, self._separated, self._stretch = _BEFORE, True, False, 0

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        if cut:  # an object cut by max_tokens may have been a call: never half sent
            self._lead.clear()
            self._body.clear()
        elif self._state == _OBJECT:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)  # the model ended inside the object
            self._to_text(out)
        elif self._state == _BEFORE:
            if self._tagged and not self._stretch:
                self._recoveries.add(kinds.INVALID_TOOL_CALL)
            if not self._stretch and not self._tagged:  # an answer of whitespace only
                self._to_text(out)
        self._state = _TEXT

    def _looks_like_call(self, body: str) -> bool:
        """A python tag or a call came before it, or it has a ``"name"`` key: meant as a call."""
        return self._tagged or self._stretch > 0 or '"name"' in body

    def _may_separate(self) -> bool:
        return self._stretch > 0 and not self._separated

    def _to_text(self, out: DeltaList) -> None:
        """The calls end: what was held (before and of the object) is content, and so is all that
        follows (but a python tag)."""
        if held := (self._lead + self._body).decode():
            out.content(held)
        self._lead.clear()
        self._body.clear()
        self._state = _TEXT
