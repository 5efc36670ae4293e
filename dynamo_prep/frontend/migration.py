"""One request's way through the pool: pick an instance, render for it, stream, move on when lost.

This module owns the request policy; ``client.py`` only carries messages. Rules:

* an instance is picked before anything is rendered, and the prompt is rendered for that
  instance's declared token, so each engine of a mixed pool gets its own image contract;
* a request moves when its worker is lost or refuses it as draining (503), at most the card's
  ``migration_limit`` times in all (one budget, whether or not tokens were streamed), and never
  back to an instance it already tried; a worker that never answered at all (unreachable: a
  black-holed or forged announce) or streamed no token by the first-token deadline costs no
  budget, and such endpoints are routed around while another instance is there;
* a constrained request (a structured output: ``response_format`` json_schema / json_object, a
  forced tool) that has streamed tokens is never continued elsewhere: the new engine would start
  its grammar again from the schema's root after the text already sent, and the client would get
  two JSON texts glued (its failure stands: a clean error); one that streamed nothing moves as any,
  but moves for free at most once (a grammar that hangs one engine must not take every engine in
  turn);
* an instance whose card says ``max_num_seqs`` is not given more requests than that (``LoadBoard``:
  this frontend's own and what its heartbeat reports); when every instance the request may go to is
  saturated, it waits for room in its model's queue, in arrival order, and past the queue's bound
  or timeout gets a 503 with ``Retry-After``;
* after a move the new instance gets the prompt rendered for ITS declaration, followed by the
  tokens already streamed, with ``max_tokens`` (and ``min_tokens``) reduced by as many, like
  Dynamo's migration; usage stays the client's: the prompt it sent and every token it received;
* a worker's usage is checked against what the frontend knows: completion tokens against the tokens
  it streamed (an engine may count a stop id it does not send: ``COMPLETION_SLACK``), prompt and
  cached tokens against the model's context length; a value that cannot be true is replaced by the
  frontend's own count (``reply_usage_replaced``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import structlog

from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.frontend.client import RequestPlaneClient, WorkerError, WorkerLost
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.frontend.load import LoadBoard, Ticket
from dynamo_prep.frontend.offload import off_loop_if_slow
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.logging import DETAIL_CHARS, RateLimiter
from dynamo_prep.preprocessor import TokenizedPrompt
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.schema_bounds import SchemaLimits
from dynamo_prep.protocol.wire import Output
from dynamo_prep.routing.router import Route, Router, RoutingPrompt

__all__ = ["Journey", "Migration", "continuation", "forked"]

log = structlog.get_logger("dynamo_prep.frontend")
# Losses that cost the client nothing to retry elsewhere: the worker never had the request, or had
# it and streamed no token before the first-token deadline (it is told to cancel).
FREE_MOVES = frozenset({"unreachable", "no_first_token"})
_T = TypeVar("_T")
# Completion tokens a worker may report beyond those it streamed: the stop ids an engine counts
# but the worker does not send (one per stop, as a rule).
COMPLETION_SLACK = 16
# Free moves a constrained request may make (its grammar may be what hangs an engine).
CONSTRAINED_FREE_MOVES = 1


class _Saturated:
    """What ``_choose`` says when the request has instances left, and none of them has room."""


_SATURATED = _Saturated()


@dataclass
class Journey:
    """One request's way through the pool: what it asked, its renders, where it went, what it streamed.

    ``prompt`` is the request rendered for the model's own (first card's) declaration: what every
    instance's prompt says except its image placeholders, so the answer parser starts from it.
    """

    model: LiveModel
    chat: ChatCompletionRequest
    request_id: str
    record: RequestRecord
    prompt: TokenizedPrompt
    budget: int
    give_up_at: float
    in_thread: bool = False
    tried: set[str] = field(default_factory=set)
    renders: dict[str | None, PreprocessedRequest] = field(default_factory=dict)
    streamed: list[int] = field(default_factory=list)
    last_error: WorkerLost | WorkerError | None = None
    route: Route | None = None  # the router's last choice
    free_moves: int = 0  # moves that cost no budget so far

    @property
    def constrained(self) -> bool:
        """A structured output: its engine applies a grammar from the schema's root."""
        return next(iter(self.renders.values())).sampling_options.structured is not None


class Migration:
    """Serves requests of the catalog's models through the router, the renderers and the client."""

    def __init__(
        self,
        catalog: ModelCatalog,
        router: Router,
        client: RequestPlaneClient,
        declarations: DeclarationPreprocessors,
        *,
        board: LoadBoard | None = None,
        on_answered: Callable[[str], None] | None = None,
        schema_limits: SchemaLimits | None = None,
    ) -> None:
        """Requests reach ``begin`` with their schemas checked against their metaschemas already
        (``api/journeys.py``); renders bound them by ``schema_limits`` again, and check nothing more."""
        self.catalog = catalog
        self.schema_limits = schema_limits or SchemaLimits()
        self.router = router
        self.client = client
        self.declarations = declarations
        self.board = board if board is not None else LoadBoard()
        self._on_answered = on_answered  # told the model's name when one of its workers answers
        self._usage_log = RateLimiter()

    async def begin(
        self,
        model: LiveModel,
        chat: ChatCompletionRequest,
        *,
        request_id: str,
        record: RequestRecord,
        timeout_s: float,
        in_thread: bool = False,
        render: Callable[[ChatCompletionRequest], tuple[PreprocessedRequest, TokenizedPrompt]] | None = None,
    ) -> Journey:
        """Render ``chat`` for the model's own declaration (a client mistake raises here, as a 400).

        ``in_thread`` renders off the loop (large bodies); a render that turns out slow moves there.
        ``render`` replaces the preprocessor's (``/v1/completions``: a prompt without a template).
        """
        declared = model.preprocessor.card.runtime_config.image_placeholder_token
        started = time.perf_counter()
        render = render or functools.partial(
            model.preprocessor.preprocess_prompt, limits=self.schema_limits, metaschema=False
        )
        request, prompt = await self._call(render, chat, in_thread=in_thread)
        record.preprocessed(request, time.perf_counter() - started)
        loop = asyncio.get_running_loop()
        journey = Journey(
            model=model,
            chat=chat,
            request_id=request_id,
            record=record,
            prompt=prompt,
            budget=model.card.migration_limit,
            give_up_at=loop.time() + timeout_s,
            in_thread=in_thread,
        )
        journey.renders[declared] = request
        return journey

    async def outputs(self, journey: Journey) -> AsyncGenerator[Output, None]:
        """The worker outputs of the journey's request, across as many instances as the budget allows.

        Raises ``WorkerLost`` / ``WorkerError`` when the request cannot continue anywhere, and a
        503 ``OpenAIError`` when no instance is live at all.
        """
        model = journey.model
        while True:
            instance = await self._admitted(journey)
            if instance is None:
                if journey.last_error is not None:
                    raise journey.last_error
                raise OpenAIError(503, f"no live instance of model {model.name!r} can take the request")
            try:
                journey.tried.add(instance.instance_id)
                base = await self._render(instance.declared_token, journey)
                route = journey.route
                journey.record.routed(instance, None if route is None else route.decision)
                log.debug(
                    "request_routed", instance_id=instance.instance_id, declared_token=instance.declared_token
                )
                if route is not None:
                    self.router.dispatch(model.name, journey.request_id, route)
                earlier = len(journey.streamed)
                try:
                    outputs = self._stream(instance, base, journey)
                    first = await anext(outputs, None)
                    self.router.prefilled(model.name, journey.request_id)
                    if first is None:
                        return
                    yield first
                    async for output in outputs:
                        yield output
                    return
                except (WorkerLost, WorkerError) as exc:
                    self._move_or_raise(exc, instance, journey, streamed=len(journey.streamed) - earlier)
                finally:
                    self.router.release(model.name, journey.request_id)
            finally:
                self.board.release(instance.instance_id)

    async def _admitted(self, journey: Journey) -> Instance | None:
        """The next instance, counted as holding the request (``LoadBoard.acquire``); None when no
        untried instance is left. While every untried one is saturated the request waits in its
        model's queue (behind those already waiting; ``SaturatedError`` past the queue's bounds)."""
        name = journey.model.name
        ticket: Ticket | None = None
        try:
            while True:
                if ticket is not None or not self.board.queued(name):
                    current = self.catalog.get(name) or journey.model
                    choice = await self._choose(current, journey)
                    if not isinstance(choice, _Saturated):
                        if choice is not None:
                            self.board.acquire(choice.instance_id)
                        return choice
                if ticket is None:
                    ticket = self.board.enqueue(name)
                    loop = asyncio.get_running_loop()
                    until = min(loop.time() + self.board.queue_timeout_s, journey.give_up_at)
                await self.board.wait(ticket, until)
        finally:
            if ticket is not None:
                self.board.leave(ticket)

    async def _choose(self, model: LiveModel, journey: Journey) -> Instance | _Saturated | None:
        """The next instance: one the request has not tried, preferably one that answers, with room
        (``_SATURATED``: there are untried ones, none with room), as the router chooses (it reads the
        prompts it needs first). Nothing awaits between the room check and the return."""
        untried = [i for instance_id, i in model.instances.items() if instance_id not in journey.tried]
        unreachable = self.client.unreachable_endpoints()
        candidates = [instance for instance in untried if instance.endpoint not in unreachable] or untried
        if not candidates:
            return None

        async def render(declared: str | None) -> RoutingPrompt:
            request = await self._render(declared, journey)
            return RoutingPrompt(request, self.declarations.placeholder(model, declared))

        prompts = await self.router.prompts(candidates, render)
        candidates = [instance for instance in candidates if not self.board.saturated(instance)]
        if not candidates:
            return _SATURATED
        route = self.router.choose(model, candidates, prompts)
        if route is None:
            return None
        journey.route = route
        return route.instance

    async def _render(self, declared: str | None, journey: Journey) -> PreprocessedRequest:
        """The prompt for a declaration (rendered once per declaration per request; a request
        without images renders the same ids for every declaration, so it is rendered once)."""
        if declared in journey.renders:
            return journey.renders[declared]
        if not journey.prompt.images:
            return next(iter(journey.renders.values()))
        started = time.perf_counter()
        preprocessor = self.declarations.get(journey.model, declared)
        if preprocessor is None:  # a new declaration: its formatter reads the model's files once
            preprocessor = await asyncio.to_thread(self.declarations.build, journey.model, declared)
        preprocess = functools.partial(preprocessor.preprocess, limits=self.schema_limits, metaschema=False)
        rendered = await self._call(preprocess, journey.chat, in_thread=journey.in_thread)
        journey.record.preprocessed(rendered, time.perf_counter() - started)
        journey.renders[declared] = rendered
        return rendered

    @staticmethod
    async def _call(
        render: Callable[[ChatCompletionRequest], _T], chat: ChatCompletionRequest, *, in_thread: bool
    ) -> _T:
        return await off_loop_if_slow(lambda: render(chat), in_thread=in_thread)

    async def _stream(
        self, instance: Instance, base: PreprocessedRequest, journey: Journey
    ) -> AsyncGenerator[Output, None]:
        """One attempt: the continuation of ``base`` on ``instance``, outputs in the client's terms."""
        earlier = len(journey.streamed)
        attempt = continuation(base, journey.streamed)
        if attempt is None:  # the budget was used up before the final message got through
            final = Output(request_id=journey.request_id, token_ids=[], finish_reason="length")
            yield _as_sent(final, base, earlier)
            return
        timeout_s = max(journey.give_up_at - asyncio.get_running_loop().time(), 0.001)
        steps = self.client.generate(
            instance.endpoint, attempt, request_id=journey.request_id, timeout_s=timeout_s
        )
        on_answered = self._on_answered  # told once, at the first output
        context_length = journey.model.preprocessor.context_length
        async with contextlib.aclosing(steps):  # leaving early cancels the generation on the worker
            async for output in steps:  # cut at max_tokens by the client
                if on_answered is not None:
                    on_answered(journey.model.name)
                    on_answered = None
                journey.streamed.extend(output.token_ids)
                checked = self._usage(output, len(journey.streamed) - earlier, context_length, journey)
                yield _as_sent(checked, base, earlier)
                if output.finish_reason is not None:
                    return

    def _usage(self, output: Output, streamed: int, context_length: int, journey: Journey) -> Output:
        """``output`` with usage that can be true: its completion tokens are the ``streamed`` ones
        (``COMPLETION_SLACK`` more at most), its prompt and cached tokens fit the context; a value
        that cannot be is replaced by the frontend's own count (0 is "not said", never refused)."""
        completion, prompt, cached = output.completion_tokens, output.prompt_tokens, output.cached_tokens
        wrong_completion = bool(completion) and not streamed <= completion <= streamed + COMPLETION_SLACK
        wrong_prompt = not 0 <= prompt <= context_length
        wrong_cached = not 0 <= cached <= max(prompt, 0)
        if not completion:
            output.completion_tokens = streamed
        if not (wrong_completion or wrong_prompt or wrong_cached):
            return output
        journey.record.metrics.worker_replies_refused.labels(reason="usage").inc()
        suppressed = self._usage_log.allow("usage", asyncio.get_running_loop().time())
        if suppressed is not None:
            log.warning(
                "reply_usage_replaced",
                request_id=journey.request_id,
                endpoint=journey.record.endpoint,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=cached,
                streamed_tokens=streamed,
                context_length=context_length,
                suppressed=suppressed,
            )
        return msgspec.structs.replace(
            output,
            completion_tokens=streamed if wrong_completion else output.completion_tokens,
            prompt_tokens=0 if wrong_prompt else prompt,  # 0: the prompt the frontend sent (_as_sent)
            cached_tokens=0 if wrong_cached or wrong_prompt else cached,
        )

    @staticmethod
    def _move_or_raise(
        exc: WorkerLost | WorkerError, instance: Instance, journey: Journey, *, streamed: int
    ) -> None:
        """Spend one move of the budget on a lost or draining worker (one that never saw the
        request, or never streamed a token of it, moves for free: a constrained request once);
        otherwise the error stands. A constrained request that streamed tokens never moves."""
        free = isinstance(exc, WorkerLost) and exc.reason in FREE_MOVES
        movable = isinstance(exc, WorkerLost) or exc.code == 503
        if movable and journey.constrained and journey.streamed:
            log.warning(
                "migration_refused",
                request_id=journey.request_id,
                from_instance_id=instance.instance_id,
                streamed_tokens=len(journey.streamed),
                reason="constrained_output",
            )
            raise OpenAIError(
                503,
                f"the worker serving this structured output was lost after {len(journey.streamed)} tokens "
                f"({str(exc)[:DETAIL_CHARS]}); it is not continued on another engine, whose grammar would "
                "start again from the schema's root: retry the request",
            ) from exc
        if free and journey.constrained and journey.free_moves >= CONSTRAINED_FREE_MOVES:
            free = False
        if not movable or (journey.budget <= 0 and not free):
            raise exc
        journey.budget -= 0 if free else 1
        journey.free_moves += 1 if free else 0
        journey.last_error = exc
        log.info(
            "request_migrated",
            request_id=journey.request_id,
            from_instance_id=instance.instance_id,
            from_endpoint=instance.endpoint,
            streamed_tokens=len(journey.streamed),
            attempt_tokens=streamed,
            moves_left=journey.budget,
            free=free,
            reason=str(exc)[:DETAIL_CHARS],
        )


def forked(journey: Journey, request_id: str, seed: int | None) -> Journey:
    """Another choice of ``journey``'s request (``n`` > 1): the same renders with ``seed``, its own
    request id, routing, budget and tokens."""
    chat = msgspec.structs.replace(journey.chat, seed=seed)
    renders = {
        declared: msgspec.structs.replace(
            request, sampling_options=msgspec.structs.replace(request.sampling_options, seed=seed)
        )
        for declared, request in journey.renders.items()
    }
    return Journey(
        model=journey.model,
        chat=chat,
        request_id=request_id,
        record=journey.record,
        prompt=journey.prompt,
        budget=journey.model.card.migration_limit,
        give_up_at=journey.give_up_at,
        in_thread=journey.in_thread,
        renders=renders,
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
    prompt_tokens = len(request.token_ids)
    return msgspec.structs.replace(
        output,
        prompt_tokens=prompt_tokens,
        completion_tokens=earlier + output.completion_tokens,
        cached_tokens=min(output.cached_tokens, prompt_tokens),
    )
