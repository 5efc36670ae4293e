"""Several choices of one response (``n`` > 1, or a batch of completions prompts), each one engine
request of its own: streamed interleaved (each event carries its choice's index, one ``[DONE]``),
collected together, usage summed (a prompt counted once however many choices it has). The first
choice that fails ends them all; closing the stream cancels every choice's generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from dynamo_prep.frontend.errors import REQUEST_ERRORS, as_openai_error, error_event
from dynamo_prep.frontend.openai_stream import DONE, Completion, answer_deltas
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.logging import DETAIL_CHARS
from dynamo_prep.protocol.openai import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChunkDelta,
    PromptTokensDetails,
    Usage,
)
from dynamo_prep.protocol.wire import Output

__all__ = [
    "INT64_MAX",
    "Choice",
    "all_or_none",
    "chat_events",
    "chat_response",
    "chat_usage_event",
    "choice_seed",
    "collect",
    "merged_sse",
    "summed_usage",
]

log = structlog.get_logger("dynamo_prep.frontend")
_encoder = msgspec.json.Encoder()
INT64_MAX = (1 << 63) - 1


@dataclass
class Choice:
    """One choice: its answer in the making and its worker outputs (the first one included)."""

    completion: Completion
    outputs: AsyncGenerator[Output, None]
    prompt_index: int = 0


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index`` (``seed - index`` where that would pass int64)."""
    if seed is None:
        return None
    return seed + index if seed <= INT64_MAX - index else seed - index


def summed_usage(choices: Sequence[Choice], record: RequestRecord) -> Usage:
    """Completion tokens of every choice, prompt (and cached) tokens once per prompt; the request's
    record is told the sums."""
    by_prompt: dict[int, Completion] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, choice.completion)
    prompt = sum(completion.prompt_tokens for completion in by_prompt.values())
    cached = sum(completion.cached_tokens for completion in by_prompt.values())
    completion_tokens = sum(choice.completion.completion_tokens for choice in choices)
    record.prompt_tokens, record.completion_tokens = prompt, completion_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None,
    )


async def collect(choices: Sequence[Choice], record: RequestRecord) -> None:
    """Every choice's answer, run together (the first failure cancels the others)."""
    await all_or_none([_drain(choice, record) for choice in choices])


async def _drain(choice: Choice, record: RequestRecord) -> None:
    async with contextlib.aclosing(choice.outputs):
        async for _ in answer_deltas(choice.outputs, choice.completion, record):
            pass


async def all_or_none(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``work`` together; the first failure cancels the rest and is raised as it is."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def chat_response(choices: Sequence[Choice], record: RequestRecord) -> ChatCompletionResponse:
    """The non-streamed chat answer of several choices."""
    first = choices[0].completion.response()
    first.choices = [choice.completion.response().choices[0] for choice in choices]
    first.usage = summed_usage(choices, record)
    return first


def chat_usage_event(choices: Sequence[Choice], record: RequestRecord) -> bytes:
    """The streamed chat answer's usage chunk (no choices), summed over the choices."""
    first = choices[0].completion
    chunk = ChatCompletionChunk(
        id=first.id, created=first.created, model=first.model, choices=[], usage=summed_usage(choices, record)
    )
    return b"data: " + _encoder.encode(chunk) + b"\n\n"


async def chat_events(choice: Choice, record: RequestRecord) -> AsyncGenerator[bytes, None]:
    """One chat choice's SSE events: its role chunk, its answer's chunks, its finish chunk."""
    completion = choice.completion
    pending = [completion.chunk(ChunkDelta(role="assistant", content=""))]
    async with contextlib.aclosing(choice.outputs):
        async for deltas in answer_deltas(choice.outputs, completion, record):
            pending += completion.chunks(deltas)
            if pending:
                yield b"".join(pending)
                pending = []
    yield completion.chunk(ChunkDelta(), completion.finish_reason)


async def merged_sse(
    streams: list[AsyncGenerator[bytes, None]], usage_event: Callable[[], bytes] | None
) -> AsyncGenerator[bytes, None]:
    """Every choice's events as they come, then usage (when asked) and ``[DONE]``; a failure after
    the response started becomes a final error event before ``[DONE]``."""
    try:
        async with contextlib.aclosing(_merged(streams)) as events:
            async for event in events:
                yield event
        if usage_event is not None:
            yield usage_event()
    except REQUEST_ERRORS as exc:
        error = as_openai_error(exc)
        log.warning("stream_failed", status=error.status, error=error.message[:DETAIL_CHARS])
        yield error_event(error) + DONE
        return
    yield DONE


async def _merged(streams: list[AsyncGenerator[bytes, None]]) -> AsyncGenerator[bytes, None]:
    """Items of every stream as they come (each stream's order kept; at most one waiting per stream)."""
    if len(streams) == 1:  # one choice, the common case: no task and queue between it and the client
        async with contextlib.aclosing(streams[0]) as only:
            async for event in only:
                yield event
        return
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(maxsize=len(streams))

    async def pump(stream: AsyncGenerator[bytes, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put(item)
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put(exc)
            return
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
