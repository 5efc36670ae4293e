"""``POST /v1/completions``: OpenAI's legacy completions, each prompt (n times) a request on the chat
path; the prompts' renders and the answer's shapes are ``frontend/completions.py``'s."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dynamo_prep.frontend.api.common import (
    JSON,
    Api,
    EventStream,
    PiecedResponse,
    SurfaceRoute,
    off_loop,
    read_body,
    unless_disconnected,
)
from dynamo_prep.frontend.api.journeys import begin, firsts
from dynamo_prep.frontend.api.params import spelled_as
from dynamo_prep.frontend.choices import Choice
from dynamo_prep.frontend.completions import TextChoices, chat_of, read_completion, renders
from dynamo_prep.frontend.logprobs import pacer_for
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.preprocessor import validate_answer_budget

__all__ = ["PARAMS", "routes"]

PARAMS = {
    "messages": "prompt",
    "max_completion_tokens": "max_tokens",
    "top_logprobs": "logprobs",
}
"""A chat parameter named in a refusal, as the completions request spells it."""


def routes(api: Api) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await _completions(api, request)

    return [SurfaceRoute("/v1/completions", completions, "POST")]


async def _completions(api: Api, request: Request) -> Response:
    body = await read_body(request, api.settings)
    asked, prompts = await off_loop(len(body), lambda: read_completion(body))
    record: RequestRecord = request.state.record
    chat = chat_of(asked)
    preprocessor = api.serving(record, chat.model).preprocessor
    begun: list[Choice] = []
    count = len(prompts) * chat.n
    pacer = pacer_for(chat, count)
    with spelled_as(PARAMS):
        validate_answer_budget(chat, count, preprocessor.context_length)
        specials = asked.add_special_tokens
        for index, render in enumerate(renders(prompts, preprocessor, add_special_tokens=specials)):
            begun += await begin(
                api, request, body, chat, "cmpl-", render=render, prompt_index=index, pacer=pacer
            )
    choices = await firsts(begun)
    shaped = TextChoices(asked, choices, prompts, preprocessor.tokenizer, record)
    if asked.stream:
        return EventStream(shaped.sse())
    answer = await unless_disconnected(request.receive, shaped.answer())
    return PiecedResponse(answer, JSON)
