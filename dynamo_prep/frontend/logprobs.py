"""Logprobs as OpenAI clients read them, rendered from the frontend's own tokenizer.

Chat (``ContentLogprobs``): the worker's per-token records (``wire.TokenLogprob``) are kept for the
tokens whose text went to the answer's ``content``; reasoning tokens, tool-call tokens and markers
are left out (docs/answers.md, "Logprobs"). The answer is fed one token at a time, and each
content delta claims the tokens whose text it is. Content deltas come back as ``LoggedContent``,
a ``ContentDelta`` carrying its tokens' entries.

Legacy completions (``LegacyLogprobs``): ``{tokens, token_logprobs, top_logprobs, text_offset}``
for every generated token, for ``/v1/completions``.

Rendered in slices (``paced``: a request's choices together render at most ``PACE_ENTRIES`` a turn
of the event loop) and, for a non-streamed answer, kept as the JSON of each slice rather than as
objects (``JsonPieces``): docs/hostile-input.md, "Answers".
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import math
from collections.abc import AsyncGenerator, Sequence
from typing import NamedTuple

import msgspec

from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.parsing import AnswerDelta, ContentDelta
from dynamo_prep.preprocessor import entries_per_token
from dynamo_prep.protocol.logprobs import CompletionLogprobs, ContentLogprob, TopLogprob
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.protocol.wire import Output, TokenLogprob
from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "PACE_ENTRIES",
    "SLOT",
    "ContentLogprobs",
    "JsonPieces",
    "LegacyLogprobs",
    "LoggedContent",
    "Pacer",
    "content_logprobs_for",
    "paced",
    "pacer_for",
    "slotted",
]

# The logprob of an impossible token (-inf, or a value JSON cannot carry), as vLLM writes it.
FLOOR_LOGPROB = -9999.0
# What one request's choices together render per turn of the event loop, in entries (a token is
# one, and with logprobs three more plus one per alternative: ``entries_per_token``). About 5 ms.
PACE_ENTRIES = 4096
_encoder = msgspec.json.Encoder()
# Where a kept JSON goes in an encoded answer: msgspec writes no NUL byte of its own (a string's is
# escaped), so each NUL of the answer is one of these.
_NUL = b"\x00"
SLOT = msgspec.Raw(_NUL)


class Pacer:
    """One request's share of the event loop: its choices together take at most ``tokens`` answer
    tokens a turn (``spend`` before rendering them; a choice over the share waits for the next
    turn), so a request of many choices, or of long logprobs, cannot hold the loop for the others."""

    def __init__(self, per_token: int, entries: int = PACE_ENTRIES) -> None:
        self.tokens = max(1, entries // per_token)
        self._spent = 0
        self._turn: asyncio.Future[None] | None = None

    async def spend(self, tokens: int) -> None:
        while self._spent >= self.tokens:
            if self._turn is None:
                loop = asyncio.get_running_loop()
                self._turn = loop.create_future()
                loop.call_soon(self._next_turn)
            await asyncio.shield(self._turn)  # a cancelled waiter leaves the others' turn alone
        self._spent += tokens

    def _next_turn(self) -> None:
        self._spent = 0
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.set_result(None)


def pacer_for(chat: ChatCompletionRequest, choices: int) -> Pacer | None:
    """A pacer for a request of several choices or with logprobs; None for one plain answer."""
    if choices < 2 and not chat.logprobs:
        return None
    return Pacer(entries_per_token(chat))


async def paced(outputs: AsyncGenerator[Output, None], pacer: Pacer) -> AsyncGenerator[Output, None]:
    """``outputs`` cut to at most ``pacer.tokens`` tokens each, each one's share spent before it
    is passed on: whatever the consumer renders per token runs in slices, however many tokens a
    worker output (or a merge of queued ones) carries."""
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            for part in _sliced(output, pacer.tokens):
                await pacer.spend(len(part.token_ids))
                yield part


def _sliced(output: Output, size: int) -> list[Output]:
    """``output`` as consecutive Outputs of at most ``size`` tokens (usage as of each one's last
    token, the finish reason on the last one)."""
    count = len(output.token_ids)
    if count <= size:
        return [output]
    records = output.logprobs if output.logprobs is not None and len(output.logprobs) == count else None
    parts = []
    for start in range(0, count, size):
        end = min(start + size, count)
        parts.append(
            msgspec.structs.replace(
                output,
                token_ids=output.token_ids[start:end],
                finish_reason=output.finish_reason if end == count else None,
                completion_tokens=output.completion_tokens - (count - end),
                logprobs=None if records is None else records[start:end],
            )
        )
    return parts


class JsonPieces:
    """A JSON array kept as the encoded items of its slices (a fraction of the objects' memory);
    ``raw()`` is the array, joined with one copy."""

    __slots__ = ("_pieces",)

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    def add(self, items: Sequence[object]) -> None:
        if items:
            self._pieces.append(_encoder.encode(items)[1:-1])

    def raw(self) -> bytes:
        return b"[" + b",".join(self._pieces) + b"]"


def slotted(body: bytes, fillings: Sequence[bytes]) -> list[bytes]:
    """An answer encoded with ``SLOT`` for each of ``fillings`` (in order), as the pieces it is
    written in: never joined into one copy (a 30 MB answer was two copies, 70 ms of the loop)."""
    if not fillings and _NUL not in body:
        return [body]  # no logprobs: splitting would copy the whole answer for nothing
    parts = body.split(_NUL)
    if len(parts) != len(fillings) + 1:
        raise ValueError(f"{len(parts) - 1} slots for {len(fillings)} fillings")
    pieces = [parts[0]]
    for filling, part in zip(fillings, parts[1:], strict=True):
        pieces += (filling, part)
    return pieces


class LoggedContent(ContentDelta, frozen=True):
    """A content delta with the logprobs of the tokens whose text it carries."""

    logprobs: list[ContentLogprob] = msgspec.field(default_factory=list)


def _logprob(value: float) -> float:
    return min(value, 0.0) if math.isfinite(value) else FLOOR_LOGPROB


class _Render:
    """Token ids as OpenAI's entries: text (U+FFFD for an incomplete UTF-8 sequence) and exact bytes."""

    def __init__(self, tokenizer: Tokenizer, top: int) -> None:
        self.tokenizer = tokenizer
        self.top = top

    def top_entry(self, token_id: int, logprob: float) -> TopLogprob:
        data = self.tokenizer.token_bytes(token_id)
        text = data.decode("utf-8", errors="replace")
        return TopLogprob(token=text, bytes=list(data), logprob=_logprob(logprob))

    def entry(self, data: bytes, record: TokenLogprob) -> ContentLogprob:
        return ContentLogprob(
            token=data.decode("utf-8", errors="replace"),
            bytes=list(data),
            logprob=_logprob(record.logprob),
            top_logprobs=[self.top_entry(other, logprob) for other, logprob in record.top[: self.top]],
        )


class _Fed(NamedTuple):
    """A fed token: its bytes and record, and where its text lies in the answer's text so far."""

    data: bytes
    record: TokenLogprob | None
    start: int
    end: int


class ContentLogprobs:
    """An ``AnswerStream`` fed token by token, its content deltas carrying their tokens' logprobs.

    ``push`` and ``finish`` stand for the stream's own (the same deltas, in the same order). The
    fed tokens' text is kept from the end of the last content claimed: a content delta is found
    there (its latest occurrence: the parser releases content as soon as it knows it is content)
    and claims the tokens whose text overlaps it (a token whose first bytes are an incomplete
    character goes with the token that completes it); tokens before it are markup or reasoning.
    """

    def __init__(self, answer: AnswerStream, tokenizer: Tokenizer, top: int) -> None:
        self._answer = answer
        self._render = _Render(tokenizer, top)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # the fed text from ``_base`` on
        self._base = 0
        self._fed: list[_Fed] = []  # the tokens not claimed yet, in order

    def push(self, token_ids: Sequence[int], records: Sequence[TokenLogprob] | None) -> list[AnswerDelta]:
        """The deltas of ``token_ids``; ``records`` (one per id; None: the worker sent none, or
        misaligned ones) give the logprobs, a token without one is left out of them."""
        if records is not None and len(records) != len(token_ids):
            records = None
        deltas: list[AnswerDelta] = []
        for index, token_id in enumerate(token_ids):
            data = self._render.tokenizer.token_bytes(token_id)
            start = self._base + len(self._text)
            self._text += self._utf8.decode(data)
            record = None if records is None else records[index]
            self._fed.append(_Fed(data, record, start, self._base + len(self._text)))
            deltas += self._claimed(self._answer.push((token_id,)))
        return deltas

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        return self._claimed(self._answer.finish(finish_reason))

    def _claimed(self, deltas: list[AnswerDelta]) -> list[AnswerDelta]:
        """``deltas``, each content delta as a ``LoggedContent`` with the tokens it claims."""
        return [
            LoggedContent(delta.text, self._claim(delta.text)) if isinstance(delta, ContentDelta) else delta
            for delta in deltas
        ]

    def _claim(self, content: str) -> list[ContentLogprob]:
        found = self._text.rfind(content)
        if not content or found < 0:
            return []
        start = self._base + found
        end = start + len(content)
        claimed = [index for index, fed in enumerate(self._fed) if fed.start < end and fed.end > start]
        if not claimed:
            return []
        first = claimed[0]
        while first > 0 and self._fed[first - 1].start == self._fed[first - 1].end == self._fed[first].start:
            first -= 1  # the first bytes of the character the first claimed token completes
        entries = [
            self._render.entry(fed.data, fed.record)
            for fed in self._fed[first : claimed[-1] + 1]
            if fed.record is not None
        ]
        del self._fed[: claimed[-1] + 1]
        self._text = self._text[end - self._base :]
        self._base = end
        return entries


def content_logprobs_for(
    chat: ChatCompletionRequest, answer: AnswerStream, tokenizer: Tokenizer
) -> ContentLogprobs | None:
    """The request's logprobs renderer, or None when it asked for none."""
    if not chat.logprobs:
        return None
    return ContentLogprobs(answer, tokenizer, chat.top_logprobs or 0)


class LegacyLogprobs:
    """``/v1/completions``' logprobs of a choice, rendered step by step (``render`` each Output's ids
    and records in order; ``text_offset`` counts the characters rendered before, from ``offset``:
    the echoed prompt's length, for instance). ``keep`` each step's to get the whole answer's
    (``kept``, as JSON)."""

    _FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self, tokenizer: Tokenizer, top: int, *, offset: int = 0) -> None:
        self._render = _Render(tokenizer, top)
        self.offset = offset
        self._kept = {name: JsonPieces() for name in self._FIELDS}

    def keep(self, rendered: CompletionLogprobs) -> None:
        for name, pieces in self._kept.items():
            pieces.add(getattr(rendered, name))

    def kept(self) -> bytes:
        """Every kept step's logprobs joined: the choice's ``logprobs`` object, encoded."""
        fields = [b'"' + name.encode() + b'":' + pieces.raw() for name, pieces in self._kept.items()]
        return b"{" + b",".join(fields) + b"}"

    def render(self, token_ids: Sequence[int], records: Sequence[TokenLogprob] | None) -> CompletionLogprobs:
        """One entry per id; without a record (the worker sent none) its logprobs are null."""
        if records is not None and len(records) != len(token_ids):
            records = None
        rendered = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for index, token_id in enumerate(token_ids):
            data = self._render.tokenizer.token_bytes(token_id)
            text = data.decode("utf-8", errors="replace")
            record = None if records is None else records[index]
            rendered.tokens.append(text)
            rendered.text_offset.append(self.offset)
            rendered.token_logprobs.append(None if record is None else _logprob(record.logprob))
            rendered.top_logprobs.append(None if record is None else self._top(text, record))
            self.offset += len(text)
        return rendered

    def _top(self, text: str, record: TokenLogprob) -> dict[str, float]:
        """The sampled token and the ``top`` most likely ones (OpenAI's legacy shape, as vLLM
        gives it: up to ``top`` + 1 entries; alternatives with the same text keep the first)."""
        top = {text: _logprob(record.logprob)}
        for other, logprob in record.top[: self._render.top]:
            text = self._render.tokenizer.token_bytes(other).decode("utf-8", errors="replace")
            top.setdefault(text, _logprob(logprob))
        return top
