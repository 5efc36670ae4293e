"""Kimi-K2 tool calls (``kimi_k2``): a section of calls, each ``functions.NAME:IDX`` (the call's id)
and its JSON arguments between special tokens::

    content <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|> ...
    <|tool_calls_section_end|>

A call's id is the model's own (``functions.NAME:IDX``, as vLLM returns it and Kimi's template
writes it back). Grammar and recoveries: docs/answers.md.
"""

from __future__ import annotations

import re
from typing import Final

from dynamo_prep.parsing import _json
from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries

__all__ = [
    "ARGUMENTS",
    "CALL_END",
    "CALL_OPEN",
    "SECTION_CLOSE",
    "SECTION_OPEN",
    "KimiK2Tools",
    "call_id_and_name",
]

SECTION_OPEN: Final = "<|tool_calls_section_begin|>"
SECTION_CLOSE: Final = "<|tool_calls_section_end|>"
CALL_OPEN: Final = "<|tool_call_begin|>"
ARGUMENTS: Final = "<|tool_call_argument_begin|>"
CALL_END: Final = "<|tool_call_end|>"
FUNCTIONS: Final = "functions."
_CALL_ID = re.compile(r".+:\d+", re.DOTALL)

# Where the half stands: content, inside the section (between calls), a call's id, its arguments.
_TEXT, _SECTION, _HEADER, _ARGUMENTS = range(4)


_WANTED: Final = {
    _TEXT: (SECTION_OPEN, CALL_OPEN),
    _SECTION: (CALL_OPEN, SECTION_CLOSE),
    _HEADER: (ARGUMENTS, CALL_END, SECTION_CLOSE, CALL_OPEN),
    _ARGUMENTS: (CALL_END, SECTION_CLOSE, CALL_OPEN),
}
"""The markers valid in each state (on a vocabulary where they are no tokens, searched in text)."""


def call_id_and_name(header: str) -> tuple[str | None, str]:
    """vLLM's reading of a call header: the id is the header up to its last ``:DIGITS`` (when it has
    one), the name the id's part before its first ``:``, without ``functions.``."""
    header = header.strip()
    match = _CALL_ID.match(header)
    call_id = match.group().strip() if match else None
    return call_id, (call_id or header).split(":")[0].removeprefix(FUNCTIONS).strip()


class KimiK2Tools(ToolHalf):
    """Content, and a call per ``<|tool_call_begin|>`` (inside the section, or opening one).

    Whitespace alone before the section and after it is not content; other text inside the section
    is dropped (counted)."""

    MARKERS = (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, ARGUMENTS, CALL_END)
    OPENERS = (SECTION_OPEN, CALL_OPEN)

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._state = _TEXT
        self._header = bytearray()  # the call's header so far (UTF-8: kept compact, it may be long)
        self._arguments = bytearray()  # its arguments so far
        self._held = bytearray()  # whitespace before the section or after it (UTF-8)
        self._holding = True  # whitespace alone is held: nothing but whitespace yet, or a section ended
        self._garbage = False  # this stretch of text inside the section is counted

    def _looking_for(self) -> tuple[str, ...]:
        return _WANTED[self._state]

    def _on_text(self, text: str, out: DeltaList) -> None:
        if self._state == _HEADER:
            self._header += text.encode()
        elif self._state == _ARGUMENTS:
            self._arguments += text.encode()
        elif self._state == _SECTION:
            if not self._garbage and text.strip():
                self._garbage = True
                self._recoveries.add(kinds.GARBAGE)
        elif self._holding and not text.strip():
            self._held += text.encode()
        else:
            if self._holding:
                self._holding = False
                text = self._held.decode() + text
                self._held.clear()
            out.content(text)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._garbage = False
        if self._state in (_HEADER, _ARGUMENTS):
            self._in_call(marker, out)
        elif marker == SECTION_OPEN and self._state == _TEXT:
            self._held.clear()
            self._state = _SECTION
        elif marker == CALL_OPEN:
            if self._state == _TEXT:
                self._recoveries.add(kinds.MISSING_TOOLS_OPEN)
                self._held.clear()
            self._state = _HEADER
        elif marker == SECTION_CLOSE and self._state == _SECTION:
            self._state, self._holding = _TEXT, True
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _in_call(self, marker: str, out: DeltaList) -> None:
        if marker == ARGUMENTS and self._state == _HEADER:
            self._state = _ARGUMENTS
        elif marker == CALL_END:
            self._end_call(out, closed=True)
            self._state = _SECTION
        elif marker == SECTION_CLOSE:
            self._end_call(out, closed=False)
            self._state, self._holding = _TEXT, True
        elif marker == CALL_OPEN:
            self._end_call(out, closed=False)
            self._state = _HEADER
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._held.clear()
        if self._state in (_HEADER, _ARGUMENTS) and not cut:  # a call cut by max_tokens is never half sent
            self._end_call(out, closed=False)
        self._state = _TEXT

    def _end_call(self, out: DeltaList, *, closed: bool) -> None:
        """The call's id and name from its header, its arguments a JSON object (none: ``{}``); one
        that is not (or has no name) is content: its header and arguments as written."""
        header, arguments = self._header.decode(), self._arguments.decode()
        self._header.clear()
        self._arguments.clear()
        call_id, name = call_id_and_name(header)
        body = arguments.strip() or "{}"
        if not name or not _json.is_object(body):
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            out.content(header + arguments)
            return
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        self._call(name, _json.compact(body), out, call_id)
