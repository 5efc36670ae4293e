"""GLM-4.5 tool calls (``glm45``): an XML-like block per call, the name first, then key/value pairs::

    content <tool_call>NAME
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are text as the model wrote them (the chat template writes strings raw and other values as
JSON): each is typed by the request's schema of that parameter, as vLLM types them (``_schema``).
Grammar and recoveries: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _json
from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._schema import parameter_types, typed_value

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
    """A call being read: its name, its pairs (keys as written, values as text) and its raw text."""

    __slots__ = ("arguments", "key", "name", "raw", "state", "value")

    def __init__(self) -> None:
        self.state = _NAME
        self.name: list[str] = []
        self.key: list[str] = []
        self.value: list[str] = []
        self.arguments: dict[str, str] = {}
        self.raw: list[str] = [CALL_OPEN]


class Glm45Tools(ToolHalf):
    """Content, and a call per ``<tool_call>`` block. Text between and after calls is content, except
    whitespace alone (the newlines between calls)."""

    MARKERS = _INNER
    OPENERS = (CALL_OPEN,)

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._block: _Call | None = None
        self._after_call = False  # a call just ended: whitespace alone is not content
        self._held = bytearray()  # that whitespace (UTF-8), released if text follows
        self._garbage = False  # this stretch of stray text inside the call is counted

    def _looking_for(self) -> tuple[str, ...]:
        return _INNER if self._block is not None else self.OPENERS

    def _on_text(self, text: str, out: DeltaList) -> None:
        block = self._block
        if block is None:
            self._content(text, out)
            return
        block.raw.append(text)
        if block.state == _NAME:
            block.name.append(text)
        elif block.state == _KEY:
            block.key.append(text)
        elif block.state == _VALUE:
            block.value.append(text)
        elif text.strip() and not self._garbage:  # text between pairs: not part of the call
            self._garbage = True
            self._recoveries.add(kinds.GARBAGE)

    def _content(self, text: str, out: DeltaList) -> None:
        if self._after_call:
            if not text.strip():
                self._held += text.encode()
                return
            self._after_call = False
            if self._held:
                text = self._held.decode() + text
                self._held.clear()
        out.content(text)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._held.clear()  # whitespace after a call, then a tag: dropped
        self._garbage = False
        block = self._block
        if marker == CALL_OPEN:
            if block is not None:
                self._end_call(out, closed=False)
            self._block, self._after_call = _Call(), False
        elif block is None:
            self._recoveries.add(kinds.UNKNOWN_TAG)
        elif marker == CALL_CLOSE:
            self._end_call(out, closed=True)
        else:
            block.raw.append(marker)
            self._pair_marker(block, marker)

    def _pair_marker(self, block: _Call, marker: str) -> None:
        """``<arg_key>`` k ``</arg_key>`` [whitespace] ``<arg_value>`` v ``</arg_value>``; a tag out of
        that order is dropped (counted), and an unclosed value is kept when the next key opens."""
        state = block.state
        if marker == KEY_OPEN:
            if state == _VALUE:
                self._end_pair(block, closed=False)
            block.state = _KEY
        elif marker == KEY_CLOSE and state == _KEY:
            block.state = _BEFORE_VALUE
        elif marker == VALUE_OPEN and state == _BEFORE_VALUE:
            block.state = _VALUE
        elif marker == VALUE_CLOSE and state == _VALUE:
            self._end_pair(block, closed=True)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _end_pair(self, block: _Call, *, closed: bool) -> None:
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CHANNEL)
        block.arguments["".join(block.key).strip()] = "".join(block.value)
        block.key.clear()
        block.value.clear()
        block.state = _PAIRS

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._held.clear()
        if self._block is not None:
            if cut:  # a call cut by max_tokens is never half sent
                self._block = None
            else:
                self._end_call(out, closed=False)

    def _end_call(self, out: DeltaList, *, closed: bool) -> None:
        """The call, its values typed by the schema; a block without a name is content, as written."""
        block, self._block = self._block, None
        self._after_call = True
        if block is None:
            return
        if block.state == _VALUE:
            self._end_pair(block, closed=False)
        name = "".join(block.name).strip()
        if not name:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            out.content("".join(block.raw) + (CALL_CLOSE if closed else ""))
            return
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        types = parameter_types(self._options.tools, name)
        members = (
            f"{_json.dumps_string(k)}:{typed_value(v, types.get(k))}" for k, v in block.arguments.items()
        )
        self._call(name, "{" + ",".join(members) + "}", out)
