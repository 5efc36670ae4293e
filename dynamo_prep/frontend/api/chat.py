"""``POST /v1/chat/completions``: OpenAI's chat completions (``n`` choices: ``choices.py``)."""

from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_prep.frontend.api.common import (
    JSON,
    Api,
    EventStream,
    SurfaceRoute,
    drain,
    encoder,
    parse_chat,
    read_body,
    unless_disconnected,
)
from dynamo_prep.frontend.api.journeys import begin, firsts
from dynamo_prep.frontend.choices import (
    Choice,
    chat_events,
    chat_response,
    chat_usage_event,
    collect,
    merged_sse,
)
from dynamo_prep.frontend.openai_stream import answer_deltas, sse
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.protocol.openai import ChatCompletionRequest

__all__ = ["routes"]


def routes(api: Api) -> list[Route]:
    async def chat_completions(request: Request) -> Response:
        return await _chat_completions(api, request)

    return [SurfaceRoute("/v1/chat/completions", chat_completions, "POST")]


async def _chat_completions(api: Api, request: Request) -> Response:
    body = await read_body(request, api.settings)
    chat = await parse_chat(body)
    record: RequestRecord = request.state.record
    choices = await firsts(await begin(api, request, body, chat, "chatcmpl-"))
    if len(choices) > 1:
        return await _chat_choices(request, chat, choices)
    [choice] = choices
    completion = choice.completion
    if chat.stream:
        include_usage = bool((chat.stream_options or {}).get("include_usage"))
        return EventStream(sse(choice.outputs, completion, record, include_usage=include_usage))
    async with contextlib.aclosing(choice.outputs):
        deltas = answer_deltas(choice.outputs, completion, record)
        await unless_disconnected(request.receive, drain(deltas))
    return Response(encoder.encode(completion.response()), media_type=JSON)


async def _chat_choices(request: Request, chat: ChatCompletionRequest, choices: list[Choice]) -> Response:
    """n > 1: the choices interleaved in one stream, or collected into one answer (``choices.py``)."""
    record: RequestRecord = request.state.record
    if chat.stream:
        include_usage = bool((chat.stream_options or {}).get("include_usage"))
        usage = (lambda: chat_usage_event(choices, record)) if include_usage else None
        streams = [chat_events(choice, record) for choice in choices]
        return EventStream(merged_sse(streams, usage))
    await unless_disconnected(request.receive, collect(choices, record))
    return Response(encoder.encode(chat_response(choices, record)), media_type=JSON)
