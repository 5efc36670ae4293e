"""From the worker's Outputs to what an OpenAI client reads: one JSON answer, or SSE chunks.

Both shapes come from one loop (``visible_text``), so streaming and non-streaming agree on the
text, the finish reason and the usage. Stopping on a stop string ends the loop early: the caller
then closes the worker stream, which cancels the generation on the worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import msgspec
import structlog

from dynamo_prep.frontend.detokenize import Detokenizer
from dynamo_prep.frontend.errors import REQUEST_ERRORS, OpenAIError, as_openai_error, error_event
from dynamo_prep.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChunkChoice,
    ChunkDelta,
    Usage,
)
from dynamo_prep.protocol.wire import Output

__all__ = ["DONE", "Completion", "sse", "visible_text"]

log = structlog.get_logger("dynamo_prep.frontend")

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


@dataclass
class Completion:
    """One response in the making: identity, detokenizer, and the usage seen so far."""

    id: str
    model: str
    created: int
    detokenizer: Detokenizer
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    def response(self) -> ChatCompletionResponse:
        message = AssistantMessage(content="".join(self.text))
        choice = ChatChoice(index=0, message=message, finish_reason=self.finish_reason)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        )

    def chunk(self, delta: ChunkDelta, finish_reason: str | None = None) -> bytes:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return _event(
            ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        )

    def usage_chunk(self) -> bytes:
        return _event(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()
            )
        )


async def visible_text(outputs: AsyncIterator[Output], completion: Completion) -> AsyncGenerator[str, None]:
    """Text pieces as they become visible; sets ``completion``'s finish reason and usage."""
    detokenizer = completion.detokenizer
    async for output in outputs:
        completion.prompt_tokens = output.prompt_tokens or completion.prompt_tokens
        completion.completion_tokens = output.completion_tokens
        piece = detokenizer.push(output.token_ids)
        if piece:
            completion.text.append(piece)
            yield piece
        if detokenizer.stopped:
            completion.finish_reason = "stop"
            return
        if output.finish_reason is not None:
            completion.finish_reason = _finish_reason(output.finish_reason)
            break
    tail = detokenizer.finish()
    if tail:
        completion.text.append(tail)
        yield tail
    if completion.finish_reason is None:
        raise OpenAIError(502, "the worker ended the stream without a final message")


async def sse(
    outputs: AsyncGenerator[Output, None],
    completion: Completion,
    *,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """The SSE body: a role chunk, content chunks, the finish chunk, usage if asked, ``[DONE]``.

    A failure after the response started cannot change the status any more, so it becomes a final
    ``data: {"error": ...}`` event before ``[DONE]`` (the OpenAI client raises it as an APIError).
    """
    try:
        async with contextlib.aclosing(outputs):
            yield completion.chunk(ChunkDelta(role="assistant", content=""))
            async for piece in visible_text(outputs, completion):
                yield completion.chunk(ChunkDelta(content=piece))
        yield completion.chunk(ChunkDelta(), completion.finish_reason)
        if include_usage:
            yield completion.usage_chunk()
    except REQUEST_ERRORS as exc:
        error = as_openai_error(exc)
        log.warning("stream_failed", status=error.status, error=error.message)
        yield error_event(error)
    yield DONE


def _finish_reason(reason: str) -> str:
    """stop / length pass through; a worker's own verdicts become errors the client understands."""
    if reason in ("stop", "length"):
        return reason
    if reason == "deadline":
        raise OpenAIError(504, "the request did not finish within the request timeout")
    raise OpenAIError(503, f"the worker ended the request early ({reason})")


def _event(chunk: ChatCompletionChunk) -> bytes:
    return b"data: " + _encoder.encode(chunk) + b"\n\n"
