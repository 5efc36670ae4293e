"""GPT-OSS answers in OpenAI's Harmony format (``--tool-call-parser openai``, ``--reasoning-parser
openai_gptoss``: one grammar, as vLLM reads both with its ``HarmonyParser``).

An answer is messages ``[<|start|>] HEADER <|message|> BODY (<|end|> | <|call|> | <|return|>)``;
the prompt opened the first one (``<|start|>assistant``). The header names the channel
(``<|channel|>analysis``: reasoning; ``final``, or ``commentary`` with no recipient: content) and,
for a tool call, the recipient (``to=functions.NAME``, with an optional ``<|constrain|>json``).
The seven markers are special ids, so structure is read from ids alone; header words are decoded
between them and read as openai-harmony reads them. Grammar and recoveries: docs/answers.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

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

__all__ = [
    "FAMILY",
    "MARKER_STRINGS",
    "MAX_HEADER_TOKENS",
    "HarmonyAnswerParser",
    "Header",
    "parse_header",
]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKER_STRINGS: Final = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
FAMILY: Final = "openai_gptoss+openai"
"""The parser's ``family`` label when both of its names are in effect."""
"""The parser's family label when both of its names are in effect."""
MAX_HEADER_TOKENS: Final = 256
"""A header longer than this without its ``<|message|>`` is no header: its text is content."""

ASSISTANT: Final = "assistant"
ROLES: Final = frozenset(("user", ASSISTANT, "system", "developer", "tool"))
BUILTIN_TOOLS: Final = frozenset(("python", "browser", "container"))
FUNCTIONS: Final = "functions."
_ENDS: Final = frozenset((END, CALL, RETURN))
_HEADER_WORDS: Final = frozenset((CHANNEL, CONSTRAIN))
_ASCII_SPACE = re.compile(r"[ \t\n\x0c\r]+")

# Where the parser stands, and what a message's body is.
_HEADER, _BODY, _BETWEEN = range(3)
_REASONING, _CONTENT, _CALL, _DROP = range(4)


@dataclass(frozen=True, slots=True)
class Header:
    """A message header as openai-harmony reads it (``extra``: words it has no place for)."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    extra: bool = False


def parse_header(text: str, *, first: bool) -> Header:
    """openai-harmony's header grammar on the decoded header (markers spelled): the channel is the
    word after ``<|channel|>``; of the remaining whitespace-separated words the first is the role
    (the prompt gave the first message's), the last a ``to=`` recipient or a content type (a lone
    word is a recipient, unless it is ``<|constrain|>...``), the one before a content type the
    recipient. vLLM's normalization follows: a recipient is cut at ``<|constrain|>``."""
    channel = None
    if (at := text.find(CHANNEL)) >= 0:
        after = text[at + len(CHANNEL) :]
        end = next((i for i, char in enumerate(after) if char.isspace() or char == "<"), len(after))
        channel = after[:end] or None
        text = text[:at] + after[end:]
    text = text.strip().replace(CONSTRAIN, " " + CONSTRAIN)
    words = [word for word in _ASCII_SPACE.split(text) if word]
    role = ASSISTANT if first else _role(words)
    if words and words[0] == role:
        words.pop(0)
    recipient = content_type = None
    if words:
        count, last = len(words), words.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif count == 1 and not last.startswith(CONSTRAIN):
            recipient = last
        else:
            content_type = last
            if words:
                raw = words.pop()
                recipient = raw.removeprefix("to=")
    if recipient is not None and (cut := recipient.find(CONSTRAIN)) >= 0:
        recipient = recipient[:cut].rstrip() or None
    return Header(role, channel, recipient, content_type, extra=bool(words))


def _role(words: list[str]) -> str:
    """A later message's role: its first word when that is a role; a header of other words is a
    tool's (openai-harmony); no words at all: the assistant's (openai-harmony refuses the header)."""
    if not words:
        return ASSISTANT
    if words[0] in ROLES:
        return words[0]
    if len(words) > 1 or words[0].startswith("to="):
        words.pop(0)
    return "tool"


def is_function(recipient: str) -> bool:
    """vLLM's ``is_function_recipient`` (chat completions): ``functions.NAME``, or a bare name that is
    no built-in tool (``python``, ``browser.*``, ``container.*``) and not ``assistant``."""
    if not recipient or recipient.startswith("<|") or recipient == ASSISTANT:
        return False
    if recipient.startswith(FUNCTIONS):
        return len(recipient) > len(FUNCTIONS)
    return recipient.split(".", 1)[0] not in BUILTIN_TOOLS


def body_of(header: Header) -> int:
    """What a message's body is, as vLLM's ``HarmonyParser`` sorts it: a call to a function
    recipient (any channel), reasoning in ``analysis``, content in ``final`` and in ``commentary``
    without a recipient; other roles, and other recipients on ``commentary``, are dropped. A body
    on an unknown channel (or none) is content (vLLM drops it)."""
    if header.role != ASSISTANT:
        return _DROP
    if header.recipient is not None and is_function(header.recipient):
        return _CALL
    if header.channel == "analysis":
        return _REASONING
    if header.channel == "final" or header.recipient is None:
        return _CONTENT
    return _DROP


class HarmonyAnswerParser(IdStreamParser[str]):
    """One GPT-OSS response. Reasoning and content stream as they decode; a call is released whole
    when its message ends (``<|call|>``, or the end of the answer: ``<|call|>`` is a stop id)."""

    def __init__(
        self,
        vocab: Vocab,
        *,
        tools_enabled: bool = True,
        call_ids: CallIds | None = None,
        family: str = FAMILY,
    ) -> None:
        specials = vocab.special_tokens
        super().__init__(vocab, {specials[m]: m for m in MARKER_STRINGS if m in specials})
        self.family = family
        self._tools_enabled = tools_enabled
        self._call_ids = call_ids or new_call_id
        self._state = _HEADER
        self._first = True  # the header the prompt opened: its role is the assistant's
        self._header = bytearray()  # the header so far, markers spelled (UTF-8)
        self._header_ids = 0
        self._marked = False  # the header holds a marker (it is one, even if it never ends)
        self._body = _CONTENT
        self._name = ""
        self._arguments = bytearray()
        self._sink: type[ReasoningDelta] | type[ContentDelta] | None = None  # where decoded text goes
        self._fresh = True  # this message (or stretch between messages) has released no text yet
        self._outside = False  # in a stretch of text outside any message (up to the next header)
        self._written: set[type[ReasoningDelta] | type[ContentDelta]] = set()
        self._calls = 0

    def _in_reasoning(self) -> bool:
        return self._state == _BODY and self._body == _REASONING

    # ------------------------------------------------------------------ ids in

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        out = DeltaList()
        cut = finish_reason == "length"
        self._recoveries.muted = cut  # what a max_tokens cut leaves unfinished is no malformed output
        self._flush(out, cut=cut)
        if self._state == _HEADER and not cut:
            self._abandon_header(out)
        elif self._state == _BODY and not (cut and self._body == _CALL):
            self._end_message(out)
        self._state = _BETWEEN
        self._recoveries.muted = False
        return out.done()

    def _on_text(self, ids: list[int], out: DeltaList) -> None:
        if self._state == _HEADER:
            room = MAX_HEADER_TOKENS - self._header_ids
            self._header += self._vocab.bytes_of(ids[:room])
            self._header_ids += min(room, len(ids))
            if len(ids) <= room:
                return
            self._overlong_header(out)
            ids = ids[room:]
        data = self._vocab.bytes_of(ids)
        if self._state == _BODY:
            if self._body == _CALL:
                self._arguments += data
            elif self._body != _DROP:
                self._text(_SINKS[self._body], self._utf8.push(data), out)
        else:
            self._between(data, out)

    def _on_tag(self, marker: str, out: DeltaList) -> None:
        self._flush(out)
        if self._state == _HEADER:
            self._header_tag(marker, out)
        elif self._state == _BODY:
            self._body_tag(marker, out)
        elif marker == START:
            self._open_header()
        elif marker == CHANNEL:  # a header without its start
            self._recoveries.add(kinds.MISSING_START)
            self._open_header()
            self._header_tag(marker, out)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    # ------------------------------------------------------------------ headers

    def _open_header(self) -> None:
        self._state, self._outside = _HEADER, False
        self._header.clear()
        self._header_ids = 0
        self._marked = False

    def _header_tag(self, marker: str, out: DeltaList) -> None:
        if marker == MESSAGE:
            self._start_body(self._header.decode(errors="replace"))
        elif marker in _HEADER_WORDS:
            if self._header_ids == MAX_HEADER_TOKENS:
                self._overlong_header(out)
                self._recoveries.add(kinds.UNKNOWN_TAG)
                return
            self._header += marker.encode()
            self._header_ids += 1
            self._marked = True
        else:  # another message's start, or an end: this header never reached its body
            self._abandon_header(out)
            self._state = _BETWEEN
            if marker == START:
                self._open_header()

    def _abandon_header(self, out: DeltaList) -> None:
        """A header the answer ended (or another marker closed) before ``<|message|>``: one with a
        marker is dropped; words alone are the model's text, content (it wrote no Harmony)."""
        text = self._header.decode(errors="replace")
        self._header.clear()
        self._first = False
        if self._marked:
            self._recoveries.add(kinds.UNTERMINATED_HEADER)
        elif text:
            self._recoveries.add(kinds.TEXT_OUTSIDE_CHANNEL)
            self._fresh = True
            self._text(ContentDelta, text, out)
            self._sink = None

    def _overlong_header(self, out: DeltaList) -> None:
        """No header runs this long: its text is content, and so is what follows up to a marker."""
        data = bytes(self._header)
        for marker in _HEADER_WORDS:
            data = data.replace(marker.encode(), b"")
        self._header.clear()
        self._recoveries.add(kinds.UNTERMINATED_HEADER)
        self._state, self._first, self._fresh, self._outside = _BETWEEN, False, True, True
        self._text(ContentDelta, self._utf8.push(data), out)

    def _start_body(self, text: str) -> None:
        header = parse_header(text, first=self._first)
        self._header.clear()
        self._first = False
        self._state, self._body, self._fresh = _BODY, body_of(header), True
        if header.extra or (self._body == _CONTENT and header.channel not in ("final", "commentary")):
            self._recoveries.add(kinds.UNKNOWN_TAG)
        if self._body == _DROP:
            self._recoveries.add(kinds.FOREIGN_MESSAGE)
        elif self._body == _CALL:
            self._name = (header.recipient or "").removeprefix(FUNCTIONS)

    # ------------------------------------------------------------------ bodies

    def _body_tag(self, marker: str, out: DeltaList) -> None:
        if marker in _ENDS:
            self._end_message(out)
            self._state = _BETWEEN
        elif marker == START:  # the model began a message without ending this one
            self._recoveries.add(kinds.UNCLOSED_CHANNEL)
            self._end_message(out)
            self._open_header()
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _end_message(self, out: DeltaList) -> None:
        if self._body != _CALL:
            return
        body = self._arguments.decode(errors="replace")
        self._arguments.clear()
        if not body.strip():
            self._release_call("{}", out)
        elif _json.is_object(body):
            self._release_call(_json.compact(body.strip()), out)
        else:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            self._text(ContentDelta, body, out)
            self._sink = None

    def _release_call(self, arguments: str, out: DeltaList) -> None:
        if not self._tools_enabled:
            self._recoveries.add(kinds.TOOL_CALL_NOT_ALLOWED)
            return
        out.append(ToolCallDelta(self._calls, self._call_ids(), self._name, arguments))
        self._calls += 1

    # ------------------------------------------------------------------ text

    def _between(self, data: bytes, out: DeltaList) -> None:
        """Text outside any message is content (counted once per stretch up to the next header; a
        stray marker does not end it); whitespace alone before it is not."""
        if not self._outside:
            if is_blank(data):
                return
            data = data.lstrip()
            self._recoveries.add(kinds.TEXT_OUTSIDE_CHANNEL)
            self._fresh, self._outside = True, True
        self._text(ContentDelta, self._utf8.push(data), out)

    def _text(self, kind: type[ReasoningDelta] | type[ContentDelta], text: str, out: DeltaList) -> None:
        """Text of the current message; a message's first text after earlier text of its kind is
        joined by a newline (as vLLM joins the messages of a whole answer)."""
        self._sink = kind
        if not text:
            return
        if self._fresh:
            self._fresh = False
            if kind in self._written:
                text = "\n" + text
            self._written.add(kind)
        out.text(kind, text)

    def _flush(self, out: DeltaList, *, cut: bool = False) -> None:
        """An incomplete character before a marker (or at the end) becomes U+FFFD (a cut drops it)."""
        tail = self._utf8.flush(cut=cut)
        if self._sink is not None:
            self._text(self._sink, tail, out)
        self._sink = None


_SINKS: Final[dict[int, type[ReasoningDelta] | type[ContentDelta]]] = {
    _REASONING: ReasoningDelta,
    _CONTENT: ContentDelta,
}
