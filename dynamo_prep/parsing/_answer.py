"""What a parser returns: deltas as ids stream in, and their fold, the whole answer."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

__all__ = [
    "AnswerDelta",
    "AnswerParser",
    "ContentDelta",
    "DeltaList",
    "ParsedAnswer",
    "ReasoningDelta",
    "ToolCallDelta",
    "assistant_message",
    "fold_deltas",
    "new_call_id",
    "parse_answer",
]


class ReasoningDelta(msgspec.Struct, frozen=True):
    text: str


class ContentDelta(msgspec.Struct, frozen=True):
    text: str


class ToolCallDelta(msgspec.Struct, frozen=True):
    """One whole tool call, released only once the model closed it (or it was recovered at the end).

    ``index`` is the call's 0-based position in this response (OpenAI's index, not the model's
    own ``index`` attribute); ``arguments`` is a JSON object text (see docs/answers.md for its form).
    """

    index: int
    id: str
    name: str
    arguments: str


AnswerDelta = ReasoningDelta | ContentDelta | ToolCallDelta


class AnswerParser(Protocol):
    """One response's output ids in, its reasoning, content and tool calls out.

    ``feed`` never raises on any ids (malformed output is recovered and counted in
    ``recoveries``); ``finish`` is called once, with ``"length"`` for a max_tokens cut and the
    model's own reason (``"stop"``) otherwise.
    """

    def feed(self, token_ids: Sequence[int]) -> list[AnswerDelta]: ...

    def finish(self, finish_reason: str) -> list[AnswerDelta]: ...

    @property
    def recoveries(self) -> Mapping[str, int]: ...

    @property
    def reasoning_tokens(self) -> int:
        """Text ids that arrived while the answer was in its reasoning part."""
        ...

    @property
    def family(self) -> str:
        """The parser in effect, by its registered names (``qwen3+hermes``, ``kimi_k3``, ``plain``)."""
        ...


class ParsedAnswer(msgspec.Struct):
    """The non-streamed answer: reasoning and content joined, the tool calls in order."""

    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]


def fold_deltas(deltas: Sequence[AnswerDelta]) -> ParsedAnswer:
    """The answer a client holds once it has read every delta."""
    reasoning = [d.text for d in deltas if isinstance(d, ReasoningDelta)]
    content = [d.text for d in deltas if isinstance(d, ContentDelta)]
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    return ParsedAnswer(reasoning="".join(reasoning), content="".join(content), tool_calls=calls)


def parse_answer(parser: AnswerParser, token_ids: Sequence[int], finish_reason: str) -> ParsedAnswer:
    """The non-streamed answer: by construction the fold of the streamed deltas."""
    deltas = parser.feed(token_ids)
    deltas.extend(parser.finish(finish_reason))
    return fold_deltas(deltas)


def assistant_message(answer: ParsedAnswer) -> dict[str, Any]:
    """The OpenAI assistant message of an answer (``reasoning_content`` as Dynamo and SGLang name it).

    Content is null when the answer is only tool calls, as OpenAI returns it. Sent back in a
    follow-up request, this message renders the turn the model wrote.
    """
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["content"] = answer.content or None
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in answer.tool_calls
        ]
    return message


def new_call_id() -> str:
    """``call_`` + 24 lowercase hex characters, unique per call."""
    return "call_" + secrets.token_hex(12)


CallIds = Callable[[], str]


class DeltaList:
    """The deltas of one ``feed``/``finish`` call, built in order; adjacent text of one kind becomes one
    delta. Text is kept in pieces and joined once, by ``done``, so building costs O(the text)."""

    __slots__ = ("_deltas", "_kind", "_parts")

    def __init__(self) -> None:
        self._deltas: list[AnswerDelta] = []
        self._kind: type[ReasoningDelta] | type[ContentDelta] | None = None
        self._parts: list[str] = []

    def text(self, kind: type[ReasoningDelta] | type[ContentDelta], text: str) -> None:
        if not text:
            return
        if kind is not self._kind:
            self._seal()
            self._kind = kind
        self._parts.append(text)

    def reasoning(self, text: str) -> None:
        self.text(ReasoningDelta, text)

    def content(self, text: str) -> None:
        self.text(ContentDelta, text)

    def append(self, call: ToolCallDelta) -> None:
        self._seal()
        self._deltas.append(call)

    def done(self) -> list[AnswerDelta]:
        """The deltas built so far (the list is the builder's own: call once, at the end)."""
        self._seal()
        return self._deltas

    def _seal(self) -> None:
        if self._kind is not None:
            self._deltas.append(self._kind("".join(self._parts)))
            self._parts.clear()
            self._kind = None
