"""From the worker's Outputs to what an OpenAI client reads: one JSON answer, or SSE chunks.

Both shapes come from one loop (``answer_deltas``), so streaming and non-streaming agree on the
reasoning, the content, the tool calls, the finish reason and the usage. A stop string ends the
loop early: the caller then closes the worker stream, which cancels the generation on the worker.

SSE cost per token: a chunk's bytes around its delta are the same for the whole response, so they
are encoded once (by msgspec, from the chunk itself) and each text delta is spliced in; the events
of one worker step go out as one body write.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.frontend.errors import REQUEST_ERRORS, OpenAIError, as_openai_error, error_event
from dynamo_prep.frontend.logprobs import ContentLogprobs, JsonPieces, LoggedContent
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.logging import DETAIL_CHARS
from dynamo_prep.parsing import AnswerDelta, ContentDelta, ReasoningDelta, ToolCallDelta
from dynamo_prep.protocol.logprobs import ChatLogprobs
from dynamo_prep.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChunkChoice,
    ChunkDelta,
    ChunkFunction,
    ChunkToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from dynamo_prep.protocol.wire import Output

__all__ = ["DONE", "Completion", "answer_deltas", "sse"]

log = structlog.get_logger("dynamo_prep.frontend")

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


@dataclass
class Completion:
    """One response in the making: identity, the answer so far, usage and how it ended."""

    id: str
    model: str
    created: int
    answer: AnswerStream
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: ContentLogprobs | None = None  # the request asked for logprobs
    keep_logprobs: bool = True  # for ``response()``: False for a streamed answer (nothing is kept)
    content_logprobs: JsonPieces = field(default_factory=JsonPieces)  # as JSON, delta by delta
    index: int = 0  # the choice's index (n > 1)
    _around_delta: tuple[bytes, bytes] | None = None

    def push(self, output: Output) -> list[AnswerDelta]:
        """The answer's deltas of one worker output (content deltas with logprobs, when asked)."""
        if self.logprobs is None:
            return self.answer.push(output.token_ids)
        return self.logprobs.push(output.token_ids, output.logprobs)

    def finish(self, reason: str) -> list[AnswerDelta]:
        return self.answer.finish(reason) if self.logprobs is None else self.logprobs.finish(reason)

    def take(self, deltas: Sequence[AnswerDelta]) -> None:
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                self.content.append(delta.text)
                if isinstance(delta, LoggedContent) and self.keep_logprobs:
                    self.content_logprobs.add(delta.logprobs)
            elif isinstance(delta, ReasoningDelta):
                self.reasoning.append(delta.text)
            else:
                self.tool_calls.append(delta)

    def end(self, reason: str) -> None:
        """``tool_calls`` when the model ended its turn with calls (OpenAI's reason), else ``reason``."""
        self.finish_reason = "tool_calls" if reason == "stop" and self.tool_calls else reason

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens)
            if self.cached_tokens
            else None,
        )

    def response(self) -> ChatCompletionResponse:
        content = "".join(self.content)
        message = AssistantMessage(content=content if content or not self.tool_calls else None)
        if self.reasoning:
            message.reasoning_content = "".join(self.reasoning)
        if self.tool_calls:
            message.tool_calls = [
                ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in self.tool_calls
            ]
        choice = ChatChoice(index=self.index, message=message, finish_reason=self.finish_reason)
        if self.logprobs is not None:
            choice.logprobs = msgspec.Raw(b'{"content":' + self.content_logprobs.raw() + b"}")
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
        )

    def chunk(
        self, delta: ChunkDelta, finish_reason: str | None = None, logprobs: ChatLogprobs | None = None
    ) -> bytes:
        choice = ChunkChoice(index=self.index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return _event(
            ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        )

    def text_chunk(self, field_name: bytes, text: str) -> bytes:
        """``chunk(ChunkDelta(<field_name>=text))``, byte for byte, without encoding the rest again."""
        if self._around_delta is None:
            empty = self.chunk(ChunkDelta())
            before, _, after = empty.rpartition(b'"delta":{}')
            self._around_delta = (before + b'"delta":{"', b"}" + after)
        before, after = self._around_delta
        return b"".join((before, field_name, b'":', _encoder.encode(text), after))

    def chunks(self, deltas: Sequence[AnswerDelta]) -> list[bytes]:
        """SSE events of ``deltas``: a call is its head (index, id, type, name) then its arguments."""
        events: list[bytes] = []
        for delta in deltas:
            if isinstance(delta, LoggedContent):
                logprobs = ChatLogprobs(content=delta.logprobs)
                events.append(self.chunk(ChunkDelta(content=delta.text), logprobs=logprobs))
            elif isinstance(delta, ContentDelta):
                events.append(self.text_chunk(b"content", delta.text))
            elif isinstance(delta, ReasoningDelta):
                events.append(self.text_chunk(b"reasoning_content", delta.text))
            else:
                head = ChunkFunction(name=delta.name, arguments="")
                call = ChunkToolCall(index=delta.index, id=delta.id, type="function", function=head)
                events.append(self.chunk(ChunkDelta(tool_calls=[call])))
                body = ChunkToolCall(index=delta.index, function=ChunkFunction(arguments=delta.arguments))
                events.append(self.chunk(ChunkDelta(tool_calls=[body])))
        return events

    def usage_chunk(self) -> bytes:
        return _event(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()
            )
        )


async def answer_deltas(
    outputs: AsyncIterator[Output], completion: Completion, record: RequestRecord
) -> AsyncGenerator[list[AnswerDelta], None]:
    """The answer's deltas, one list per worker output (possibly empty: nothing visible yet); sets
    ``completion``'s finish reason and usage before the last list."""
    answer = completion.answer
    try:
        async for output in outputs:
            completion.prompt_tokens = output.prompt_tokens or completion.prompt_tokens
            completion.completion_tokens = output.completion_tokens
            completion.cached_tokens = output.cached_tokens or completion.cached_tokens
            deltas = completion.push(output)
            reason = "stop" if answer.stopped else output.finish_reason  # a stop string ends it all
            if reason is not None and not answer.stopped:
                reason = _finish_reason(reason)
                deltas += completion.finish(reason)
            completion.take(deltas)
            if reason is not None:
                completion.end(reason)
            yield deltas
            if completion.finish_reason is not None:
                return
        raise OpenAIError(502, "the worker ended the stream without a final message")
    finally:
        record.answered(
            completion.finish_reason,
            answer.tool_calls,
            answer.reasoning_tokens,
            answer.recoveries,
            family=answer.family,
        )


async def sse(
    outputs: AsyncGenerator[Output, None],
    completion: Completion,
    record: RequestRecord,
    *,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """The SSE body: a role chunk, the answer's chunks, the finish chunk, usage if asked, ``[DONE]``.

    One item per worker output, each the events it made visible: the role chunk goes out with the
    first output's, and the last output's go out with the finish chunk, usage and ``[DONE]``.
    A failure after the response started cannot change the status any more, so it becomes a final
    ``data: {"error": ...}`` event before ``[DONE]`` (the OpenAI client raises it as an APIError).
    """
    pending = [completion.chunk(ChunkDelta(role="assistant", content=""))]
    try:
        async with contextlib.aclosing(outputs):
            async for deltas in answer_deltas(outputs, completion, record):
                pending += completion.chunks(deltas)
                if completion.finish_reason is None and pending:
                    yield b"".join(pending)
                    pending = []
        pending.append(completion.chunk(ChunkDelta(), completion.finish_reason))
        if include_usage:
            pending.append(completion.usage_chunk())
    except REQUEST_ERRORS as exc:
        error = as_openai_error(exc)
        log.warning("stream_failed", status=error.status, error=error.message[:DETAIL_CHARS])
        pending.append(error_event(error))
    pending.append(DONE)
    yield b"".join(pending)


def _finish_reason(reason: str) -> str:
    """stop / length pass through; a worker's own verdicts become errors the client understands."""
    if reason in ("stop", "length"):
        return reason
    if reason == "deadline":
        raise OpenAIError(504, "the request did not finish within the request timeout")
    raise OpenAIError(503, f"the worker ended the request early ({reason})")


def _event(chunk: ChatCompletionChunk) -> bytes:
    return b"data: " + _encoder.encode(chunk) + b"\n\n"
