"""OpenAI legacy completions (``POST /v1/completions``) request and response types.

What is served and refused, and how a prompt is tokenized: docs/frontend.md "Completions".
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo_prep.protocol.decode import decoding
from dynamo_prep.protocol.logprobs import CompletionLogprobs
from dynamo_prep.protocol.openai import Int, Name, RequestError, Tag, Usage

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "parse_completion_request",
    "prompts_of",
]

# OpenAI's (and vLLM's) default max_tokens for /v1/completions.
DEFAULT_MAX_TOKENS = 16

# One prompt: its text, or its token ids.
Prompt = str | list[int]


class CompletionRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``POST /v1/completions`` body (unknown fields are ignored, like OpenAI servers do).

    ``prompt`` is a string, a list of strings, a list of token ids or a list of lists of ids
    (``prompts_of`` checks which).
    """

    model: Name
    prompt: str | list[Any]
    suffix: str | None = None
    max_tokens: Int | None = None
    min_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool = False
    n: Int = 1
    best_of: Int | None = None
    echo: bool = False
    logprobs: Int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: Tag | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS


def parse_completion_request(body: bytes) -> CompletionRequest:
    """The body decoded; a bad field raises ``RequestError`` naming it."""
    with decoding(RequestError.naming_field):
        return msgspec.json.decode(body, type=CompletionRequest)


def prompts_of(prompt: str | list[Any]) -> list[Prompt]:
    """The request's prompts: each a string or a list of ids (``RequestError`` naming ``prompt``
    for any other shape, or an empty batch)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt must not be an empty list", param="prompt")
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(_is_id(item) for item in prompt):
        return [list(prompt)]
    if all(isinstance(item, list) and item and all(_is_id(i) for i in item) for item in prompt):
        return [list(item) for item in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of non-empty lists "
        "of token ids",
        param="prompt",
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice; a non-streamed one's ``logprobs`` is already encoded (``msgspec.Raw``)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | msgspec.Raw | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """The non-streamed answer (``text_completion``)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE event of a streamed completion; the usage chunk has no choices."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
