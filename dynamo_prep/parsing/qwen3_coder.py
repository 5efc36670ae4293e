"""Qwen3-Coder XML tool calls (``qwen3_coder``):

```
content <tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter> ...
</function>
</tool_call> [content]
```

``<tool_call>``/``</tool_call>`` are added tokens in Qwen vocabularies (matched on their ids); the
function and parameter tags are text. A value is raw text (one newline on each side dropped), typed
by the declared tool's schema as vLLM types it (``_schema_types``). A call is released whole when
its function closes. Grammar, recoveries and how this differs from vLLM's parser: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._schema_types import typed_arguments

__all__ = [
    "FUNCTION",
    "FUNCTION_CLOSE",
    "PARAMETER",
    "PARAMETER_CLOSE",
    "TOOL_CALL",
    "TOOL_CALL_CLOSE",
    "Qwen3CoderTools",
]

TOOL_CALL: Final = "<tool_call>"
TOOL_CALL_CLOSE: Final = "</tool_call>"
FUNCTION: Final = "<function="
FUNCTION_CLOSE: Final = "</function>"
PARAMETER: Final = "<parameter="
PARAMETER_CLOSE: Final = "</parameter>"
CLOSE_ANGLE: Final = ">"

# Where the half stands: content; inside <tool_call> before a function; a function's name (up to
# its ">"); between parameters; a parameter's key (up to its ">"); its value; after </function>.
_CONTENT, _PREAMBLE, _NAME, _ARGS, _KEY, _VALUE, _BETWEEN = range(7)
# Text read in one state may move to another within that text (past a name's ">"): what a state
# looks for includes what the states it moves to that way look for.
_IN_FUNCTION: Final = (PARAMETER, PARAMETER_CLOSE, FUNCTION_CLOSE, TOOL_CALL_CLOSE, TOOL_CALL, FUNCTION)
_WANTED: Final = {
    _CONTENT: (TOOL_CALL, FUNCTION),
    _PREAMBLE: (FUNCTION, TOOL_CALL_CLOSE, TOOL_CALL),
    _NAME: _IN_FUNCTION,
    _ARGS: _IN_FUNCTION,
    _KEY: _IN_FUNCTION,
    _VALUE: (PARAMETER, PARAMETER_CLOSE, FUNCTION_CLOSE),  # a value's text may spell the wrapper tags
    _BETWEEN: (TOOL_CALL_CLOSE, TOOL_CALL, FUNCTION),
}
_FUNCTION_STATES: Final = frozenset((_NAME, _ARGS, _KEY, _VALUE))


class Qwen3CoderTools(ToolHalf):
    """Content, and a call per ``<function=NAME>`` (inside ``<tool_call>``, or without it as vLLM
    accepts). Whitespace alone between and after calls is dropped; other text there is content."""

    MARKERS = (TOOL_CALL, TOOL_CALL_CLOSE, FUNCTION, FUNCTION_CLOSE, PARAMETER, PARAMETER_CLOSE)
    OPENERS = (TOOL_CALL, FUNCTION)

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._state = _CONTENT
        self._raw: list[str] = []  # the call as written, until its name is read (content if no call)
        self._name: list[str] = []
        self._key: list[str] = []
        self._value: list[str] = []
        self._arguments: dict[str, str] = {}
        self._garbage = False  # text outside a parameter was counted in this stretch
        self._after = False  # after a call: whitespace alone is no content
        self._held = bytearray()  # that whitespace (UTF-8), released if text follows

    def _looking_for(self) -> tuple[str, ...]:
        return _WANTED[self._state]

    # -- text -----------------------------------------------------------------------------------

    def _on_text(self, text: str, out: DeltaList) -> None:
        state = self._state
        if state == _VALUE:
            self._value.append(text)
        elif state in (_NAME, _KEY):
            self._on_head_text(text, out)
        elif state == _ARGS:
            if not self._garbage and text.strip():
                self._garbage = True
                self._recoveries.add(kinds.GARBAGE)  # text between parameters: dropped
        elif state == _PREAMBLE:
            self._raw.append(text)
        else:
            self._on_outside_text(text, out)

    def _on_head_text(self, text: str, out: DeltaList) -> None:
        """A name or key, up to its ``>``; what follows is the arguments or the value."""
        head, closed, rest = text.partition(CLOSE_ANGLE)
        if self._state == _KEY:
            self._key.append(head)
            if closed:
                self._state = _VALUE
                self._value.append(rest)
            return
        self._name.append(head)
        self._raw.append(head + closed)
        if closed:
            if not "".join(self._name).strip():
                self._not_a_call(out)
                self._on_outside_text(rest, out)
                return
            self._raw.clear()
            self._state, self._garbage = _ARGS, False
            if rest:
                self._on_text(rest, out)

    def _on_outside_text(self, text: str, out: DeltaList) -> None:
        if not text:
            return
        if self._after:
            if not text.strip():
                self._held += text.encode()
                return
            self._after = False
            self._state = _CONTENT
            if self._held:
                text = self._held.decode() + text
                self._held.clear()
        out.content(text)

    # -- markers --------------------------------------------------------------------------------

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._held.clear()  # whitespace between markers: dropped
        self._garbage = False
        state = self._state
        if marker == TOOL_CALL:
            self._end_any(out)
            self._state, self._raw = _PREAMBLE, [TOOL_CALL]
        elif marker == FUNCTION:
            if state in _FUNCTION_STATES:  # a new function before this one closed: it ends here
                self._end_any(out)
                self._state = _BETWEEN
            self._open_function(out)
        elif marker == TOOL_CALL_CLOSE and state != _CONTENT:
            if state == _PREAMBLE:
                self._raw.append(TOOL_CALL_CLOSE)
            self._end_any(out)
            self._state, self._after = _CONTENT, True
        elif state in _FUNCTION_STATES:
            self._on_function_marker(marker, out)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)  # a tag where it does not belong: dropped

    def _open_function(self, out: DeltaList) -> None:
        if self._state == _CONTENT:
            self._recoveries.add(kinds.MISSING_TOOLS_OPEN)  # no <tool_call> around it
        elif self._state == _PREAMBLE and "".join(self._raw[1:]).strip():
            self._recoveries.add(kinds.GARBAGE)  # text between <tool_call> and the function
        if self._state != _PREAMBLE:
            self._raw = []
        self._raw.append(FUNCTION)
        self._state = _NAME

    def _on_function_marker(self, marker: str, out: DeltaList) -> None:
        """``<parameter=``, ``</parameter>`` or ``</function>`` (or a wrapper tag spelled in a value)."""
        state = self._state
        if state == _NAME:
            self._raw.append(marker)
            self._not_a_call(out)  # the name never closed
            return
        if state == _KEY and marker != PARAMETER_CLOSE:
            self._recoveries.add(kinds.ARGUMENT_WITHOUT_KEY)  # its ">" never came: dropped
            self._key.clear()
        if marker == PARAMETER_CLOSE:
            if state == _VALUE:
                self._end_value()
            elif state == _KEY:
                self._recoveries.add(kinds.ARGUMENT_WITHOUT_KEY)
                self._key.clear()
            else:
                self._recoveries.add(kinds.UNKNOWN_TAG)
            self._state = _ARGS
            return
        if state == _VALUE:
            self._recoveries.add(kinds.UNCLOSED_CHANNEL)  # a value without </parameter>: kept
            self._end_value()
        if marker == PARAMETER:
            self._state = _KEY
        elif marker == FUNCTION_CLOSE:
            self._end_function(out, closed=True)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)
            self._state = _ARGS

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._held.clear()
        if cut:  # what max_tokens cut is never half sent
            if self._state in (_PREAMBLE, *_FUNCTION_STATES):
                self._reset_call()
        else:
            self._end_any(out)
        self._state = _CONTENT

    # -- calls ----------------------------------------------------------------------------------

    def _end_any(self, out: DeltaList) -> None:
        """Whatever is open ends here (the wrapper's close, a new wrapper, the end of the answer)."""
        state = self._state
        if state == _PREAMBLE:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)  # a wrapper without a function
            out.content("".join(self._raw))
            self._reset_call()
        elif state == _NAME:
            self._not_a_call(out)
        elif state in _FUNCTION_STATES:
            if state == _KEY:
                self._recoveries.add(kinds.ARGUMENT_WITHOUT_KEY)
                self._key.clear()
            elif state == _VALUE:
                self._recoveries.add(kinds.UNCLOSED_CHANNEL)
                self._end_value()
            self._end_function(out, closed=False)

    def _not_a_call(self, out: DeltaList) -> None:
        """A function whose name never closed (or is empty): its text is content."""
        self._recoveries.add(kinds.INVALID_TOOL_CALL)
        out.content("".join(self._raw))
        self._reset_call()
        self._state, self._after = _CONTENT, False

    def _end_value(self) -> None:
        key = "".join(self._key).lstrip()
        value = "".join(self._value)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if key in self._arguments:
            self._recoveries.add(kinds.DUPLICATE_ARGUMENT)  # the later value, in the first place
        self._arguments[key] = value
        self._key.clear()
        self._value.clear()

    def _end_function(self, out: DeltaList, *, closed: bool) -> None:
        name = "".join(self._name).strip()
        arguments = typed_arguments(self._arguments, self._options.tool_properties.get(name))
        self._reset_call()
        self._state, self._after = _BETWEEN, True
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        self._call(name, arguments, out)

    def _reset_call(self) -> None:
        self._raw, self._name, self._key, self._value = [], [], [], []
        self._arguments = {}
