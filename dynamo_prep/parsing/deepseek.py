"""DeepSeek tool calls and reasoning: ``deepseek_v3`` and ``deepseek_v31`` tool parsers, and the
``deepseek_v3`` reasoning parser (thinking on: DeepSeek-R1's, off: none).

```
content <｜tool▁calls▁begin｜>
  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>   (V3)
  <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>                         (V3.1)
  ... <｜tool▁calls▁end｜> [content]
```

The five markers are added tokens in DeepSeek vocabularies: matched on their ids (in the text on a
vocabulary without them). A call is released whole at its end marker. Grammar, recoveries and how
this differs from vLLM's parsers: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _json
from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing.think import DeepSeekR1Reasoning

__all__ = [
    "CALLS_BEGIN",
    "CALLS_END",
    "CALL_BEGIN",
    "CALL_END",
    "TOOL_SEP",
    "DeepSeekV3Reasoning",
    "DeepSeekV3Tools",
    "DeepSeekV31Tools",
]

CALLS_BEGIN: Final = "<｜tool▁calls▁begin｜>"
CALLS_END: Final = "<｜tool▁calls▁end｜>"
CALL_BEGIN: Final = "<｜tool▁call▁begin｜>"
CALL_END: Final = "<｜tool▁call▁end｜>"
TOOL_SEP: Final = "<｜tool▁sep｜>"
FENCE: Final = "```"
JSON_FENCE: Final = "```json"

# Where the half stands: content, inside the calls section (between calls), in a call's head
# (before the separator), in a call's body (after it).
_CONTENT, _SECTION, _HEAD, _BODY = range(4)
_WANTED: Final = {
    _CONTENT: (CALLS_BEGIN, CALL_BEGIN),
    _SECTION: (CALL_BEGIN, CALLS_END),
    _HEAD: (TOOL_SEP, CALL_END, CALL_BEGIN, CALLS_END),
    _BODY: (CALL_END, CALL_BEGIN, CALLS_END),
}


class DeepSeekV31Tools(ToolHalf):
    """Content and calls ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (DeepSeek-V3.1).

    Whitespace alone between calls and after the section is dropped; other text there is content.
    """

    MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)
    OPENERS = (CALLS_BEGIN, CALL_BEGIN)

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._state = _CONTENT
        self._in_section = False
        self._head: list[str] = []
        self._body: list[str] = []
        self._after = False  # between calls or after them: whitespace alone is no content
        self._held = bytearray()  # that whitespace (UTF-8), released if text follows

    def _looking_for(self) -> tuple[str, ...]:
        return _WANTED[self._state]

    def _on_text(self, text: str, out: DeltaList) -> None:
        if self._state == _HEAD:
            self._head.append(text)
        elif self._state == _BODY:
            self._body.append(text)
        elif self._after:
            if not text.strip():
                self._held += text.encode()
                return
            if self._held:
                text = self._held.decode() + text
                self._held.clear()
            self._after = False
            out.content(text)
        else:
            out.content(text)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._held.clear()  # whitespace between markers: dropped
        state = self._state
        if marker == CALL_BEGIN:
            if state in (_HEAD, _BODY):
                self._end_call(out, closed=False)
            elif not self._in_section:
                self._recoveries.add(kinds.MISSING_TOOLS_OPEN)  # a call outside the calls section
            self._state = _HEAD
        elif marker == TOOL_SEP and state == _HEAD:
            self._state = _BODY
        elif marker == CALL_END and state in (_HEAD, _BODY):
            self._end_call(out, closed=True)
        elif marker == CALLS_BEGIN and state == _CONTENT:
            self._state, self._in_section, self._after = _SECTION, True, True
        elif marker == CALLS_END and state != _CONTENT:
            if state != _SECTION:
                self._end_call(out, closed=False)
            self._state, self._in_section, self._after = _CONTENT, False, True
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)  # a marker where it does not belong: dropped

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._held.clear()
        if self._state in (_HEAD, _BODY):
            if cut:  # a call cut by max_tokens is never half sent
                self._head.clear()
                self._body.clear()
            else:
                self._end_call(out, closed=False)
        self._state = _CONTENT

    def _end_call(self, out: DeltaList, *, closed: bool) -> None:
        """The call in head and body ends (``closed``: by its end marker): a call, or its text as
        content when it is none."""
        separated = self._state == _BODY
        head, body = "".join(self._head), "".join(self._body)
        self._head.clear()
        self._body.clear()
        self._state = _SECTION if self._in_section else _CONTENT
        self._after = True
        parsed = self._parse(head, body) if separated else None
        if parsed is None:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            text = CALL_BEGIN + head + (TOOL_SEP + body if separated else "") + (CALL_END if closed else "")
            out.content(text)
            return
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        self._call(*parsed, out)

    def _parse(self, head: str, body: str) -> tuple[str, str] | None:
        """(name, arguments) of a call: the head is the name, the body a JSON object."""
        return _named(head.strip(), body)


class DeepSeekV3Tools(DeepSeekV31Tools):
    """Content and DeepSeek-V3 calls: the head is the type (``function``), the body the name's line,
    then the JSON object fenced as ```` ```json ````."""

    def _parse(self, head: str, body: str) -> tuple[str, str] | None:
        name, _, rest = body.partition("\n")
        rest = rest.strip()
        if rest.startswith(FENCE):
            rest = rest.removeprefix(JSON_FENCE) if rest.startswith(JSON_FENCE) else rest.removeprefix(FENCE)
            rest = rest.removesuffix(FENCE)
        return _named(name.strip(), rest)


def _named(name: str, arguments: str) -> tuple[str, str] | None:
    """(name, compact arguments) when ``name`` is not empty and ``arguments`` a JSON object."""
    arguments = arguments.strip()
    if not name or not _json.is_object(arguments):
        return None
    return name, _json.compact(arguments)


class DeepSeekV3Reasoning(DeepSeekR1Reasoning):
    """vLLM's ``deepseek_v3``: with thinking (the request's ``thinking``/``enable_thinking`` template
    kwarg, or a prompt that opened the block) DeepSeek-R1's reasoning; without, no reasoning at all
    (the answer is content; a think tag token is markup, dropped and counted)."""

    def __init__(
        self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries, tools: ToolHalf
    ) -> None:
        super().__init__(options, text_markers, recoveries, tools)
        if not (options.thinking_requested or options.thinking):
            self.in_reasoning = self._start = False
            self.passing = True
