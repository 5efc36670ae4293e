"""Kimi-K3 answers parsed on token ids: the XTML channels of an assistant turn.

The four markers ``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>`` are special ids and
model or user text is never encoded as one, so structure is read from ids alone: a string value
that spells ``<|close|>argument<|sep|>`` stays a value. Grammar, recoveries and the form of the
returned arguments: docs/answers.md.

Invariants: feeding never raises; no marker and no header text of a structural tag is ever
released as text; a tool call is released whole, once closed; the same ids give the same answer
and the same recoveries however they are chunked.
"""

from __future__ import annotations

from typing import Final, Literal

from dynamo_prep.formatter.kimi_k3 import CLOSE, END_OF_MSG, OPEN, SEP
from dynamo_prep.parsing import _json
from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import (
    AnswerDelta,
    CallIds,
    ContentDelta,
    DeltaList,
    ReasoningDelta,
    ToolCallDelta,
    new_call_id,
)
from dynamo_prep.parsing._stream import IdStreamParser
from dynamo_prep.parsing._tokens import Vocab, is_blank
from dynamo_prep.parsing._xtml import (
    ARGUMENT,
    CALL,
    JSON,
    KNOWN,
    MESSAGE,
    PARENT,
    RESPONSE,
    THINK,
    TOOLS,
    Header,
    parse,
    parse_unterminated,
)

__all__ = ["MARKER_STRINGS", "MAX_HEADER_TOKENS", "KimiK3AnswerParser"]

MARKER_STRINGS: Final = (OPEN, CLOSE, SEP, END_OF_MSG)
MAX_HEADER_TOKENS: Final = 256
"""A tag header longer than this without its ``<|sep|>`` is taken as a missing sep (its text flows on)."""

_OPEN, _CLOSE, _SEP, _END = range(4)
_TEXT_CHANNELS: Final[dict[str | None, type[ReasoningDelta] | type[ContentDelta]]] = {
    THINK: ReasoningDelta,
    RESPONSE: ContentDelta,
}
_VALUE_TYPES_RAW: Final = ("string", None)


class _Call:
    """A call being read: its name and, in order, its arguments or its one raw json block."""

    __slots__ = ("arguments", "cut", "elements", "name", "raw")

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.arguments: dict[str, str] = {}  # key -> the value's JSON text
        self.raw: str | None = None
        self.elements = 0
        self.cut = False  # the model stopped inside one of its elements

    def json_arguments(self) -> str:
        if self.raw is not None:
            return self.raw
        return "{" + ",".join(f"{_json.dumps_string(k)}:{v}" for k, v in self.arguments.items()) + "}"


class KimiK3AnswerParser(IdStreamParser[int]):
    """One K3 response. ``prompt_form="hosted"`` starts at message level (the model opens its own
    channel); the reference form starts inside ``think`` (``thinking``) or ``response``."""

    family = "kimi_k3"

    def __init__(
        self,
        vocab: Vocab,
        *,
        thinking: bool,
        prompt_form: Literal["reference", "hosted"] = "reference",
        tools_enabled: bool = True,
        call_ids: CallIds | None = None,
    ) -> None:
        specials = vocab.special_tokens
        super().__init__(vocab, {specials[s]: kind for kind, s in enumerate(MARKER_STRINGS)})
        self._tools_enabled = tools_enabled
        self._call_ids = call_ids or new_call_id
        self._stack: list[str] = [MESSAGE]
        if prompt_form == "reference":
            self._stack.append(THINK if thinking else RESPONSE)
        self._fresh = prompt_form == "reference"  # the prompt's channel, nothing written in it yet
        self._closed = False  # the message is over (closed, ended, or finished)
        self._header: list[int] | None = None
        self._header_kind = _OPEN
        self._sink: type[ReasoningDelta] | type[ContentDelta] | None = None  # what the decoder feeds
        self._outside = False  # this stretch of message-level text flows as content
        self._garbage = False  # this stretch of misplaced text is already counted
        self._call: _Call | None = None
        self._value = bytearray()
        self._value_attrs: dict[str, str] = {}
        self._calls = 0

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        out = DeltaList()
        if self._closed:
            return out.done()
        cut = finish_reason == "length"
        if self._header is not None:
            if cut:
                self._header = None
            else:
                self._end_header(out, terminated=False)
        self._end_stretch(out, cut=cut)
        self._recoveries.muted = cut
        if not self._closed:
            if cut and self._call is not None:
                self._call.cut = True  # a max_tokens cut never releases a call that was not closed
            self._end_message(out)
        self._end_stretch(out)
        self._recoveries.muted = False
        return out.done()

    # ------------------------------------------------------------------ ids in

    def _in_reasoning(self) -> bool:
        return not self._closed and self._header is None and self._stack[-1] == THINK

    def _on_text(self, ids: list[int], out: DeltaList) -> None:
        if self._header is not None:
            room = MAX_HEADER_TOKENS - len(self._header)
            self._header.extend(ids[:room])
            if len(ids) <= room:
                return
            self._end_header(out, terminated=False)
            ids = ids[room:]
        self._text(self._vocab.bytes_of(ids), out)

    def _on_tag(self, marker: int, out: DeltaList) -> None:
        self._end_stretch(out)
        if self._header is not None:
            self._end_header(out, terminated=marker == _SEP)
            self._end_stretch(out)
            if marker == _SEP:
                return
        if marker in (_OPEN, _CLOSE):
            self._header, self._header_kind = [], marker
        elif marker == _SEP:
            self._recoveries.add(kinds.GARBAGE)
        elif not self._closed:
            self._end_message(out)
        self._end_stretch(out)

    # ------------------------------------------------------------------ text

    def _text(self, data: bytes, out: DeltaList) -> None:
        """Text between markers, routed by where it stands."""
        top = self._stack[-1] if not self._closed else None
        channel = _TEXT_CHANNELS.get(top)
        if channel is not None:
            if self._fresh and not is_blank(data):
                self._fresh = False
            self._sink = channel
            out.text(channel, self._utf8.push(data))
        elif top in (ARGUMENT, JSON):
            self._value += data
        elif top == MESSAGE:
            self._message_text(data, out)
        elif not self._garbage and not is_blank(data):
            self._garbage = True
            self._recoveries.add(kinds.GARBAGE)

    def _message_text(self, data: bytes, out: DeltaList) -> None:
        """Text outside any channel is content; a stretch of only whitespace is dropped (whitespace
        before a stretch's first other byte is not kept: it is dropped either way)."""
        if not self._outside:
            if is_blank(data):
                return
            data = data.lstrip()
            self._outside = True
            self._recoveries.add(kinds.TEXT_OUTSIDE_CHANNEL)
        self._sink = ContentDelta
        out.text(ContentDelta, self._utf8.push(data))

    def _end_stretch(self, out: DeltaList, *, cut: bool = False) -> None:
        tail = self._utf8.flush(cut=cut)
        if self._sink is not None:
            out.text(self._sink, tail)
        self._sink = None
        self._outside = self._garbage = False

    # ------------------------------------------------------------------ tags

    def _end_header(self, out: DeltaList, *, terminated: bool) -> None:
        ids, self._header = self._header or [], None
        text = self._vocab.bytes_of(ids).decode("utf-8", errors="replace")
        header = parse(text) if terminated else parse_unterminated(text)
        if not terminated:
            self._recoveries.add(kinds.MISSING_SEP if header.name is not None else kinds.UNKNOWN_TAG)
        if header.name is not None:
            if self._header_kind == _OPEN:
                self._open(header, out)
            else:
                self._close(header.name, out)
        elif terminated:
            self._recoveries.add(kinds.UNKNOWN_TAG)
        if header.rest:
            self._end_stretch(out)
            self._text(header.rest.encode("utf-8"), out)

    def _open(self, header: Header, out: DeltaList) -> None:
        name = header.name
        assert name is not None
        fresh, self._fresh = self._fresh, False
        if self._closed or name not in PARENT:
            self._recoveries.add(kinds.UNKNOWN_TAG)
            return
        if fresh and name in (THINK, RESPONSE):
            self._stack.pop()  # the prompt already opened a channel: the model's own opener wins
        elif (parent := PARENT[name]) in self._stack:
            self._unwind(self._stack.index(parent), out, keep_element=parent == CALL)
        elif name == CALL:
            self._unwind(0, out, keep_element=False)
            self._recoveries.add(kinds.MISSING_TOOLS_OPEN)
            self._stack.append(TOOLS)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)
            return
        self._stack.append(name)
        if name == CALL:
            self._call = _Call(header.attrs.get("tool"))
        elif name in (ARGUMENT, JSON):
            self._value.clear()
            self._value_attrs = header.attrs

    def _close(self, name: str, out: DeltaList) -> None:
        self._fresh = False
        if self._closed or name not in KNOWN or name not in self._stack:
            self._recoveries.add(kinds.UNKNOWN_TAG)
            return
        target = self._stack.index(name)
        self._unwind(target, out, keep_element=name == CALL)
        self._pop(out, explicit=True, keep_element=True)
        if name == MESSAGE:
            self._closed = True

    def _end_message(self, out: DeltaList) -> None:
        """The message ends without its close tag (``<|end_of_msg|>`` or the end of the stream)."""
        self._unwind(0, out, keep_element=False)
        self._pop(out, explicit=False, keep_element=False)
        self._closed = True

    def _unwind(self, target: int, out: DeltaList, *, keep_element: bool) -> None:
        """Closes, implicitly, every element above ``self._stack[target]``."""
        while len(self._stack) > target + 1:
            self._pop(out, explicit=False, keep_element=keep_element)

    def _pop(self, out: DeltaList, *, explicit: bool, keep_element: bool) -> None:
        """Ends the innermost element; an implicit end is counted by what it leaves behind."""
        name = self._stack.pop()
        count = self._recoveries.add
        if name == THINK:
            if not explicit:
                count(kinds.MISSING_THINK_CLOSE)
        elif name in (ARGUMENT, JSON):
            self._end_element(name, explicit or keep_element)
            if not explicit and keep_element:
                count(kinds.UNCLOSED_CHANNEL)
        elif name == CALL:
            self._end_call(out, explicit)
        elif not explicit:
            count(kinds.UNCLOSED_CHANNEL)

    def _end_element(self, name: str, complete: bool) -> None:
        call = self._call
        if call is None:
            return
        if not complete:
            call.cut = True
            return
        value = bytes(self._value).decode("utf-8", errors="replace")
        self._value.clear()
        count = self._recoveries.add
        call.elements += 1
        if call.raw is not None or (name == JSON and call.elements > 1):
            count(kinds.EXTRA_CALL_ELEMENT)
        elif name == JSON:
            call.raw = value
            if not _json.is_object(value):
                count(kinds.INVALID_JSON_BLOCK)
        elif (key := self._value_attrs.get("key")) is None:
            count(kinds.ARGUMENT_WITHOUT_KEY)
        else:
            if key in call.arguments:
                count(kinds.DUPLICATE_ARGUMENT)
            call.arguments[key] = self._argument_json(value)

    def _argument_json(self, value: str) -> str:
        """A string (or untyped) value is raw text; any other type is its JSON, compacted."""
        if self._value_attrs.get("type") in _VALUE_TYPES_RAW:
            return _json.dumps_string(value)
        try:
            _json.loads(value)
        except _json.JsonError:
            self._recoveries.add(kinds.INVALID_ARGUMENT_VALUE)
            return _json.dumps_string(value)
        return _json.compact(value)

    def _end_call(self, out: DeltaList, explicit: bool) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        count = self._recoveries.add
        if not explicit:
            if call.cut or call.elements == 0:
                count(kinds.DROPPED_CALL)
                return
            count(kinds.UNCLOSED_CALL)
        if call.name is None:
            count(kinds.CALL_WITHOUT_TOOL)
        elif not self._tools_enabled:
            count(kinds.TOOL_CALL_NOT_ALLOWED)
        else:
            out.append(ToolCallDelta(self._calls, self._call_ids(), call.name, call.json_arguments()))
            self._calls += 1
