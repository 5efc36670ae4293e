"""GLM-4.5 tool calls (``glm45``): an XML-like block per call, the name first, then key/value pairs::

    content <tool_call>NAME
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are text as the model wrote them (the chat template writes strings raw and other values as
JSON): each is typed by the request's schema of that parameter, as vLLM types them (``_schema_types``).
Grammar and recoveries: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import BetweenCalls, ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._schema_types import typed_arguments

__all__ = ["CALL_CLOSE", "CALL_OPEN", "KEY_CLOSE", "KEY_OPEN", "VALUE_CLOSE", "VALUE_OPEN", "Glm45Tools"]

CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"
KEY_OPEN: Final = "<arg_key>"
KEY_CLOSE: Final = "</arg_key>"
VALUE_OPEN: Final = "<arg_value>"
VALUE_CLOSE: Final = "</arg_value>"
_INNER: Final = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)

# Inside a call: its name, between pairs, a key, between a key and its value, a value.
_NAME, _PAIRS, _KEY, _BEFORE_VALUE, _VALUE = range(5)


class _Call:
    """A call being read: its raw text (UTF-8, kept compact: a value may be long), the spans of its
    name and of the key or value being read in it, and its pairs (keys stripped, values as text)."""

    __slots__ = ("arguments", "key", "name", "raw", "start", "state")

    def __init__(self) -> None:
        self.state = _NAME
        self.raw = bytearray(CALL_OPEN.encode())
        self.start = len(self.raw)  # where the name, key or value being read starts in ``raw``
        self.name: str | None = None
        self.key = ""
        self.arguments: dict[str, str] = {}

    def since_start(self, end: int | None = None) -> str:
        return self.raw[self.start : end].decode()


class Glm45Tools(ToolHalf):
    """Content, and a call per ``<tool_call>`` block. Text between and after calls is content, except
    whitespace alone (the newlines between calls)."""

    MARKERS = _INNER
    OPENERS = (CALL_OPEN,)

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._block: _Call | None = None
        self._between = BetweenCalls()
        self._garbage = False  # this stretch of stray text inside the call is counted

    def _looking_for(self) -> tuple[str, ...]:
        return _INNER if self._block is not None else self.OPENERS

    def _on_text(self, text: str, out: DeltaList) -> None:
        block = self._block
        if block is None:
            self._between.content(text, out)
            return
        block.raw += text.encode()
        if block.state in (_PAIRS, _BEFORE_VALUE) and text.strip() and not self._garbage:
            self._garbage = True  # text between pairs: not part of the call
            self._recoveries.add(kinds.GARBAGE)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._between.drop_held()  # whitespace after a call, then a tag: dropped
        self._garbage = False
        block = self._block
        if marker == CALL_OPEN:
            if block is not None:
                self._end_call(out, closed=False)
            self._block, self._between.after_call = _Call(), False
        elif block is None:
            self._recoveries.add(kinds.UNKNOWN_TAG)
        elif marker == CALL_CLOSE:
            self._end_call(out, closed=True)
        else:
            at = len(block.raw)
            block.raw += marker.encode()
            self._pair_marker(block, marker, at)

    def _pair_marker(self, block: _Call, marker: str, at: int) -> None:
        """``<arg_key>`` k ``</arg_key>`` [whitespace] ``<arg_value>`` v ``</arg_value>`` (``at``: where
        the marker starts in the raw text); a tag out of that order is dropped (counted), and an
        unclosed value is kept when the next key opens. The first tag ends the name."""
        state = block.state
        if state == _NAME:
            block.name, state = block.since_start(at).strip(), _PAIRS
        if marker == KEY_OPEN:
            if state == _VALUE:
                self._end_pair(block, at, closed=False)
            block.state, block.start = _KEY, len(block.raw)
        elif marker == KEY_CLOSE and state == _KEY:
            block.key, block.state = block.since_start(at).strip(), _BEFORE_VALUE
        elif marker == VALUE_OPEN and state == _BEFORE_VALUE:
            block.state, block.start = _VALUE, len(block.raw)
        elif marker == VALUE_CLOSE and state == _VALUE:
            self._end_pair(block, at, closed=True)
        else:
            block.state = state
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _end_pair(self, block: _Call, at: int, *, closed: bool) -> None:
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CHANNEL)
        block.arguments[block.key] = block.since_start(at)
        block.state = _PAIRS

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._between.drop_held()
        if self._block is not None:
            if cut:  # a call cut by max_tokens is never half sent
                self._block = None
            else:
                self._end_call(out, closed=False)

    def _end_call(self, out: DeltaList, *, closed: bool) -> None:
        """The call, its values typed by the schema; a block without a name is content, as written."""
        block, self._block = self._block, None
        self._between.after_call = True
        if block is None:
            return
        if block.state == _VALUE:
            self._end_pair(block, len(block.raw), closed=False)
        name = block.since_start().strip() if block.name is None else block.name
        if not name:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            out.content(block.raw.decode() + (CALL_CLOSE if closed else ""))
            return
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        self._call(name, typed_arguments(block.arguments, self._options.tool_properties.get(name)), out)
