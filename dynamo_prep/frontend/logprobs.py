"""Logprobs as OpenAI clients read them, rendered from the frontend's own tokenizer.

Chat (``ContentLogprobs``): the worker's per-token records (``wire.TokenLogprob``) are kept for the
tokens whose text went to the answer's ``content``; reasoning tokens, tool-call tokens and markers
are left out (docs/answers.md, "Logprobs"). The answer is fed one token at a time so each token's
fate is seen: a reasoning token is dropped at once, other tokens wait until a delta claims them; a
content delta claims the run of waiting tokens whose text it is (else the run whose text holds it,
else the waiting tokens whose text is part of it), and the rest are markup. Content deltas come back
as ``LoggedContent``, a ``ContentDelta`` carrying its tokens' entries.

Legacy completions (``LegacyLogprobs``): ``{tokens, token_logprobs, top_logprobs, text_offset}``
for every generated token, for ``/v1/completions``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.parsing import AnswerDelta, ContentDelta
from dynamo_prep.protocol.logprobs import ChatLogprobs, CompletionLogprobs, ContentLogprob, TopLogprob
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.protocol.wire import TokenLogprob
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["ContentLogprobs", "LegacyLogprobs", "LoggedContent", "content_logprobs_for", "token_bytes"]

# The logprob of an impossible token (-inf, or a value JSON cannot carry), as vLLM writes it.
FLOOR_LOGPROB = -9999.0
# How far back a content delta looks for the tokens whose text it is.
_MAX_RUN_SEARCH = 64


class LoggedContent(ContentDelta, frozen=True):
    """A content delta with the logprobs of the tokens whose text it carries."""

    logprobs: list[ContentLogprob] = msgspec.field(default_factory=list)


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """A token's exact bytes (empty for an id outside the vocabulary)."""
    try:
        data: bytes = tokenizer.encoding.decode_single_token_bytes(token_id)
    except KeyError:
        return b""
    return data


def _logprob(value: float) -> float:
    return min(value, 0.0) if math.isfinite(value) else FLOOR_LOGPROB


class _Render:
    """Token ids as OpenAI's entries: text (U+FFFD for an incomplete UTF-8 sequence) and exact bytes."""

    def __init__(self, tokenizer: Tokenizer, top: int) -> None:
        self.tokenizer = tokenizer
        self.top = top

    def top_entry(self, token_id: int, logprob: float) -> TopLogprob:
        data = token_bytes(self.tokenizer, token_id)
        text = data.decode("utf-8", errors="replace")
        return TopLogprob(token=text, bytes=list(data), logprob=_logprob(logprob))

    def entry(self, data: bytes, record: TokenLogprob) -> ContentLogprob:
        return ContentLogprob(
            token=data.decode("utf-8", errors="replace"),
            bytes=list(data),
            logprob=_logprob(record.logprob),
            top_logprobs=[self.top_entry(other, logprob) for other, logprob in record.top[: self.top]],
        )


class ContentLogprobs:
    """An ``AnswerStream`` fed token by token, its content deltas carrying their tokens' logprobs.

    ``push`` and ``finish`` stand for the stream's own (the same deltas, in the same order).
    """

    def __init__(self, answer: AnswerStream, tokenizer: Tokenizer, top: int) -> None:
        self._answer = answer
        self._render = _Render(tokenizer, top)
        self._waiting: list[tuple[bytes, TokenLogprob | None]] = []

    def push(self, token_ids: Sequence[int], records: Sequence[TokenLogprob] | None) -> list[AnswerDelta]:
        """The deltas of ``token_ids``; ``records`` (one per id; None: the worker sent none, or
        misaligned ones) give the logprobs, a token without one is left out of them."""
        if records is not None and len(records) != len(token_ids):
            records = None
        deltas: list[AnswerDelta] = []
        answer = self._answer
        for index, token_id in enumerate(token_ids):
            reasoning = answer.reasoning_tokens
            fed = answer.push((token_id,))
            if answer.reasoning_tokens == reasoning:  # a reasoning token is no content token
                data = token_bytes(self._render.tokenizer, token_id)
                self._waiting.append((data, None if records is None else records[index]))
            deltas += self._claimed(fed)
        return deltas

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        return self._claimed(self._answer.finish(finish_reason))

    def _claimed(self, deltas: list[AnswerDelta]) -> list[AnswerDelta]:
        """``deltas`` with the waiting tokens the content claims on their last content delta."""
        if not deltas:
            return deltas
        last = max((i for i, delta in enumerate(deltas) if isinstance(delta, ContentDelta)), default=None)
        if last is None:
            self._waiting.clear()
            return deltas
        content = "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
        claimed = [
            self._render.entry(data, record) for data, record in self._claim(content) if record is not None
        ]
        self._waiting.clear()
        out = list(deltas)
        out[last] = LoggedContent(out[last].text, claimed)  # type: ignore[union-attr]
        return out

    def _claim(self, content: str) -> list[tuple[bytes, TokenLogprob | None]]:
        waiting = self._waiting
        low = max(len(waiting) - _MAX_RUN_SEARCH, 0)
        holding: list[tuple[bytes, TokenLogprob | None]] | None = None
        for end in range(len(waiting), low, -1):
            data = b""
            for start in range(end - 1, low - 1, -1):
                data = waiting[start][0] + data
                text = data.decode("utf-8", errors="replace")
                if text == content:
                    return waiting[start:end]
                if holding is None and content in text:
                    holding = waiting[start:end]
                if len(text) > len(content) + 8:
                    break
        if holding is not None:
            return holding
        return [pair for pair in waiting if pair[0] and pair[0].decode("utf-8", "replace") in content]


def content_logprobs_for(
    chat: ChatCompletionRequest, answer: AnswerStream, tokenizer: Tokenizer
) -> ContentLogprobs | None:
    """The request's logprobs renderer, or None when it asked for none."""
    if not chat.logprobs:
        return None
    return ContentLogprobs(answer, tokenizer, chat.top_logprobs or 0)


def chat_logprobs(entries: list[ContentLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=entries)


class LegacyLogprobs:
    """``/v1/completions``' logprobs of a choice, rendered step by step (``render`` each Output's ids
    and records in order; ``text_offset`` counts the characters rendered before, from ``offset``:
    the echoed prompt's length, for instance)."""

    def __init__(self, tokenizer: Tokenizer, top: int, *, offset: int = 0) -> None:
        self._render = _Render(tokenizer, top)
        self.offset = offset

    def render(self, token_ids: Sequence[int], records: Sequence[TokenLogprob] | None) -> CompletionLogprobs:
        """One entry per id; without a record (the worker sent none) its logprobs are null."""
        if records is not None and len(records) != len(token_ids):
            records = None
        rendered = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for index, token_id in enumerate(token_ids):
            data = token_bytes(self._render.tokenizer, token_id)
            text = data.decode("utf-8", errors="replace")
            record = None if records is None else records[index]
            rendered.tokens.append(text)
            rendered.text_offset.append(self.offset)
            rendered.token_logprobs.append(None if record is None else _logprob(record.logprob))
            rendered.top_logprobs.append(None if record is None else self._top(record))
            self.offset += len(text)
        return rendered

    def _top(self, record: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for other, logprob in record.top[: self._render.top]:
            text = token_bytes(self._render.tokenizer, other).decode("utf-8", errors="replace")
            top.setdefault(text, _logprob(logprob))
        return top
