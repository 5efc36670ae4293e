"""OpenAI's logprobs shapes, as the frontend renders them (docs/answers.md, "Logprobs").

Chat: ``choices[].logprobs`` is ``{"content": [{token, bytes, logprob, top_logprobs}]}``.
Legacy completions: ``choices[].logprobs`` is ``{tokens, token_logprobs, top_logprobs, text_offset}``.
"""

from __future__ import annotations

import msgspec

__all__ = ["ChatLogprobs", "CompletionLogprobs", "ContentLogprob", "TopLogprob"]


class TopLogprob(msgspec.Struct, kw_only=True):
    """One alternative at a position: its text (U+FFFD for an incomplete UTF-8 sequence), its exact
    bytes, its log probability."""

    token: str
    bytes: list[int]
    logprob: float


class ContentLogprob(msgspec.Struct, kw_only=True):
    """One content token: its text, bytes and log probability, and the most likely alternatives."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """A chat choice's (or chunk's) ``logprobs``: the content tokens it covers."""

    content: list[ContentLogprob]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """A legacy completion choice's ``logprobs``: parallel lists, one entry per token; ``top_logprobs``
    maps each alternative's text to its logprob; ``text_offset`` is where the token's text starts in
    the choice's text (characters)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
