"""The chat path the generating surfaces share (chat, completions, responses): a request's n choices
begun on the pool (``begin``) and their first outputs awaited together (``firsts``), so a failure up
to there still gets its own HTTP status."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request

from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.frontend.answers import answer_stream_for
from dynamo_prep.frontend.api.common import THREAD_ABOVE_BYTES, Api, off_loop, unless_disconnected
from dynamo_prep.frontend.choices import Choice, choice_seed
from dynamo_prep.frontend.completions import Render, plain_answer
from dynamo_prep.frontend.errors import REQUEST_ERRORS, OpenAIError, as_openai_error
from dynamo_prep.frontend.logprobs import Pacer, content_logprobs_for, paced, pacer_for
from dynamo_prep.frontend.migration import forked
from dynamo_prep.frontend.openai_stream import Completion
from dynamo_prep.frontend.request_ids import plane_id
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.preprocessor import stop_strings, validate_answer_budget, validate_n
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.protocol.wire import Output

__all__ = ["begin", "firsts"]

# A stop string's character costs this many body bytes in that choice: the stop matcher's automaton
# takes ~0.7 us per character to build, so the largest stop list (16 Ki characters) builds in a thread.
STOP_CHAR_WEIGHT = 16


async def begin(
    api: Api,
    request: Request,
    body: bytes,
    chat: ChatCompletionRequest,
    id_prefix: str,
    *,
    render: Render | None = None,
    prompt_index: int = 0,
    pacer: Pacer | None = None,
) -> list[Choice]:
    """The request's n choices begun on the pool (a client mistake raises here, as a 400): each
    its own journey (choice i's seed is seed + i; ``choices.py``), from one render. ``render``
    replaces the chat render (completions: plain text, no parser, the budget checked and the
    ``pacer`` made for all prompts by the caller)."""
    record: RequestRecord = request.state.record
    model = api.serving(record, chat.model)
    validate_n(chat.n)
    if render is None:
        validate_answer_budget(chat, chat.n, model.preprocessor.context_length)
        pacer = pacer_for(chat, chat.n)
        await _check_schemas(api, request, chat, model)
    request_id: str = request.state.request_id
    plane = plane_id(request_id)
    journey = await api.migration.begin(
        model,
        msgspec.structs.replace(chat, n=1),
        request_id=plane,
        record=record,
        timeout_s=api.settings.request_timeout_s,
        in_thread=len(body) > THREAD_ABOVE_BYTES,
        render=render,
    )
    journeys = [journey]
    journeys += [forked(journey, f"{plane}.{i}", choice_seed(chat.seed, i)) for i in range(1, chat.n)]
    tokenizer, rendered = model.preprocessor.tokenizer, journey.prompt.rendered
    created = int(time.time())
    choices = []
    for i, each in enumerate(journeys):
        if render is None:
            answer = await off_loop(
                len(body) + STOP_CHAR_WEIGHT * sum(map(len, stop_strings(chat.stop))),
                lambda: answer_stream_for(model.card, tokenizer, chat, rendered),
            )
        else:
            answer = plain_answer(tokenizer, chat)
        completion = Completion(
            id=f"{id_prefix}{request_id}", model=chat.model, created=created, answer=answer,
            index=prompt_index * chat.n + i, keep_logprobs=not chat.stream,
        )  # fmt: skip
        if render is None:
            completion.logprobs = content_logprobs_for(chat, answer, tokenizer)
        outputs = _observed(api.migration.outputs(each), record)
        if pacer is not None:  # the choices' tokens rendered in slices, the loop turning between
            outputs = paced(outputs, pacer)
        choices.append(Choice(completion, outputs, prompt_index))
    return choices


async def _check_schemas(api: Api, request: Request, chat: ChatCompletionRequest, model: LiveModel) -> None:
    """The request's schemas bounded (on the loop: one linear pass within the limits), then checked
    against their metaschemas in the checker processes, the check stopped if the client leaves."""
    uses = model.preprocessor.schemas_to_check(chat, limits=api.settings.schema_limits)
    if uses:
        await unless_disconnected(request.receive, api.schemas.check(uses))


async def firsts(choices: list[Choice]) -> list[Choice]:
    """The choices with their first outputs in (awaited together): a failure up to here keeps its
    HTTP status, and closes every choice."""
    if len(choices) == 1:
        [choice] = choices
        first = await _first(choice.outputs)
        choice.outputs = _prepend(first, choice.outputs)
        return choices
    started = [asyncio.ensure_future(_first(choice.outputs)) for choice in choices]
    try:
        await asyncio.gather(*started)
    except BaseException:
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        for choice in choices:
            await choice.outputs.aclose()
        raise
    for choice, task in zip(choices, started, strict=True):
        choice.outputs = _prepend(task.result(), choice.outputs)
    return choices


async def _first(outputs: AsyncGenerator[Output, None]) -> Output:
    """The first output: failures up to here still get their own HTTP status."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise OpenAIError(502, "the worker ended the stream without a final message") from None


async def _prepend(first: Output, rest: AsyncGenerator[Output, None]) -> AsyncGenerator[Output, None]:
    yield first
    async with contextlib.aclosing(rest):
        async for output in rest:
            yield output


async def _observed(
    outputs: AsyncGenerator[Output, None], record: RequestRecord
) -> AsyncGenerator[Output, None]:
    """``outputs``, each one shown to ``record`` (timings, usage) and a failure recorded as it passes."""
    try:
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                record.output(output)
                yield output
    except REQUEST_ERRORS as exc:
        error = as_openai_error(exc)
        record.fail(error.status, error.message)
        raise
