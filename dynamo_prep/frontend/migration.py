"""One request's way through the pool: pick an instance, render for it, stream, move on when lost.

This module owns the request policy; ``client.py`` only carries messages. Rules:

* an instance is picked before anything is rendered, and the prompt is rendered for that
  instance's declared token, so each engine of a mixed pool gets its own image contract;
* a request moves when its worker is lost or refuses it as draining (503), at most the card's
  ``migration_limit`` times in all (one budget, whether or not tokens were streamed), and never
  back to an instance it already tried; a worker that never answered at all (unreachable: a
  black-holed or forged announce) costs no budget, and unreachable endpoints are routed around
  while another instance is there;
* after a move the new instance gets the prompt rendered for ITS declaration, followed by the
  tokens already streamed, with ``max_tokens`` (and ``min_tokens``) reduced by as many, like
  Dynamo's migration; usage stays the client's: the prompt it sent and every token it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import msgspec
import structlog

from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.frontend.client import RequestPlaneClient, WorkerError, WorkerLost
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.frontend.router import Router
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Output

__all__ = ["Migration", "continuation"]

log = structlog.get_logger("dynamo_prep.frontend")


@dataclass
class _Journey:
    """What one request has done so far: where it went, its renders, what it streamed."""

    budget: int
    give_up_at: float
    tried: set[str] = field(default_factory=set)
    renders: dict[str | None, PreprocessedRequest] = field(default_factory=dict)
    streamed: list[int] = field(default_factory=list)
    last_error: WorkerLost | WorkerError | None = None


class Migration:
    """Serves requests of the catalog's models through the router, the renderers and the client."""

    def __init__(
        self,
        catalog: ModelCatalog,
        router: Router,
        client: RequestPlaneClient,
        declarations: DeclarationPreprocessors,
    ) -> None:
        self.catalog = catalog
        self.router = router
        self.client = client
        self.declarations = declarations

    async def outputs(
        self,
        model: LiveModel,
        chat: ChatCompletionRequest,
        *,
        request_id: str,
        record: RequestRecord,
        timeout_s: float,
        in_thread: bool = False,
    ) -> AsyncGenerator[Output, None]:
        """The worker outputs for ``chat``, across as many instances as the budget allows.

        Raises ``WorkerLost`` / ``WorkerError`` when the request cannot continue anywhere, and a
        503 ``OpenAIError`` when no instance is live at all. ``in_thread`` renders off the loop.
        """
        loop = asyncio.get_running_loop()
        journey = _Journey(budget=model.card.migration_limit, give_up_at=loop.time() + timeout_s)
        while True:
            current = self.catalog.get(model.name) or model
            instance = self.router.pick(current, excluded=journey.tried | self._unreachable(current))
            if instance is None:
                instance = self.router.pick(current, excluded=journey.tried)
            if instance is None:
                if journey.last_error is not None:
                    raise journey.last_error
                raise OpenAIError(503, f"no live instance of model {model.name!r} can take the request")
            journey.tried.add(instance.instance_id)
            base = await self._render(model, instance, chat, journey, record, in_thread=in_thread)
            record.routed(instance)
            try:
                async for output in self._stream(instance, base, journey, request_id):
                    yield output
                return
            except (WorkerLost, WorkerError) as exc:
                self._move_or_raise(exc, instance, journey, request_id)

    async def _render(
        self,
        model: LiveModel,
        instance: Instance,
        chat: ChatCompletionRequest,
        journey: _Journey,
        record: RequestRecord,
        *,
        in_thread: bool,
    ) -> PreprocessedRequest:
        """The prompt for ``instance``'s declaration (rendered once per declaration per request)."""
        declared = instance.declared_token
        if declared in journey.renders:
            return journey.renders[declared]
        started = time.perf_counter()
        preprocessor = self.declarations.get(model, declared)
        if preprocessor is None:  # a new declaration: its formatter reads the model's files once
            preprocessor = await asyncio.to_thread(self.declarations.build, model, declared)
        if in_thread:
            rendered = await asyncio.to_thread(preprocessor.preprocess, chat)
        else:
            rendered = preprocessor.preprocess(chat)
        record.preprocessed(rendered, time.perf_counter() - started)
        log.debug("request_routed", instance_id=instance.instance_id, declared_token=declared)
        journey.renders[declared] = rendered
        return rendered

    async def _stream(
        self, instance: Instance, base: PreprocessedRequest, journey: _Journey, request_id: str
    ) -> AsyncGenerator[Output, None]:
        """One attempt: the continuation of ``base`` on ``instance``, outputs in the client's terms."""
        earlier = len(journey.streamed)
        attempt = continuation(base, journey.streamed)
        if attempt is None:  # the budget was used up before the final message got through
            yield _as_sent(Output(request_id=request_id, token_ids=[], finish_reason="length"), base, earlier)
            return
        timeout_s = max(journey.give_up_at - asyncio.get_running_loop().time(), 0.001)
        steps = self.client.generate(instance.endpoint, attempt, request_id=request_id, timeout_s=timeout_s)
        async with contextlib.aclosing(steps):
            async for output in steps:
                journey.streamed.extend(output.token_ids)
                yield _as_sent(output, base, earlier)

    def _unreachable(self, model: LiveModel) -> set[str]:
        """Instance ids of the model whose endpoints never answered a recent request."""
        endpoints = self.client.unreachable_endpoints()
        if not endpoints:
            return set()
        return {
            instance_id for instance_id, instance in model.instances.items() if instance.endpoint in endpoints
        }

    @staticmethod
    def _move_or_raise(
        exc: WorkerLost | WorkerError, instance: Instance, journey: _Journey, request_id: str
    ) -> None:
        """Spend one move of the budget on a lost or draining worker (an unreachable one, which
        never saw the request, moves for free); otherwise the error stands."""
        unreachable = isinstance(exc, WorkerLost) and exc.reason == "unreachable"
        movable = isinstance(exc, WorkerLost) or exc.code == 503
        if not movable or (journey.budget <= 0 and not unreachable):
            raise exc
        journey.budget -= 0 if unreachable else 1
        journey.last_error = exc
        log.info(
            "request_migrated",
            request_id=request_id,
            from_instance_id=instance.instance_id,
            from_endpoint=instance.endpoint,
            streamed_tokens=len(journey.streamed),
            moves_left=journey.budget,
            reason=str(exc),
        )


def continuation(request: PreprocessedRequest, streamed: list[int]) -> PreprocessedRequest | None:
    """The request to send after ``streamed`` tokens went out; None when no token budget is left."""
    if not streamed:
        return request
    stop = request.stop_conditions
    remaining = stop.max_tokens - len(streamed)
    if remaining <= 0:
        return None
    min_tokens = None if stop.min_tokens is None else max(stop.min_tokens - len(streamed), 0)
    return msgspec.structs.replace(
        request,
        token_ids=[*request.token_ids, *streamed],
        stop_conditions=msgspec.structs.replace(stop, max_tokens=remaining, min_tokens=min_tokens),
    )


def _as_sent(output: Output, request: PreprocessedRequest, earlier: int) -> Output:
    """Usage as the client sees it: its own prompt, and the tokens of earlier attempts added."""
    if not earlier and output.prompt_tokens:
        return output
    return msgspec.structs.replace(
        output, prompt_tokens=len(request.token_ids), completion_tokens=earlier + output.completion_tokens
    )
