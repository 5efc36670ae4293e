"""``POST /v1/responses``: OpenAI's Responses API, the request served as a chat request (its
translation: ``frontend/responses_request.py``; the answer's items and events: ``frontend/responses.py``)."""

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
    encoder,
    off_loop,
    read_body,
    unless_disconnected,
)
from dynamo_prep.frontend.api.journeys import begin, firsts
from dynamo_prep.frontend.api.params import spelled_as
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.frontend.responses import ResponseBuilder, collect_response, response_events
from dynamo_prep.frontend.responses_request import read_request

__all__ = ["PARAMS", "routes"]

PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
"""A chat parameter named in a refusal, as the Responses request spells it."""


def routes(api: Api) -> list[Route]:
    async def responses(request: Request) -> Response:
        return await _responses(api, request)

    return [SurfaceRoute("/v1/responses", responses, "POST")]


async def _responses(api: Api, request: Request) -> Response:
    body = await read_body(request, api.settings)
    asked, chat = await off_loop(len(body), lambda: read_request(body))
    record: RequestRecord = request.state.record
    with spelled_as(PARAMS):
        [choice] = await firsts(await begin(api, request, body, chat, "resp_"))
    builder = ResponseBuilder(choice.completion, asked)
    if asked.stream:
        return EventStream(response_events(choice.outputs, builder, record))
    async with contextlib.aclosing(choice.outputs):
        built = collect_response(choice.outputs, builder, record)
        answer = await unless_disconnected(request.receive, built)
    return Response(encoder.encode(answer), media_type=JSON)
