"""The OpenAI-compatible HTTP frontend, on the same event loop as the discovery watcher.

Why this stack: docs/frontend.md. Routes: ``POST /v1/chat/completions`` (``n`` choices: ``choices.py``),
``POST /v1/completions`` and ``POST /v1/responses`` (translated to chat requests: ``completions.py``,
``responses.py``), ``GET /v1/models``, ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes), ``GET /health`` (readiness: 503 until a model is live),
``GET /live`` and ``GET /metrics`` (Prometheus). Every response carries
``x-request-id`` (an incoming one is honoured); every error has OpenAI's body (``errors.py``);
every request ends with one ``request_finished`` or ``request_failed`` line (``request_record.py``),
which also updates the request metrics. A chat request's way through the pool (pick, render for the
pick, stream, move on loss) is ``migration.py``'s; this module turns its outputs into OpenAI
responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.frontend.answers import answer_stream_for
from dynamo_prep.frontend.choices import (
    Choice,
    chat_events,
    chat_response,
    chat_usage_event,
    choice_seed,
    collect,
    merged_sse,
)
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.frontend.completions import (
    Render,
    TextChoices,
    chat_of,
    completion_params,
    plain_answer,
    read_completion,
    renders,
)
from dynamo_prep.frontend.config import HttpSettings
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.errors import REQUEST_ERRORS, OpenAIError, as_openai_error, error_response
from dynamo_prep.frontend.load import LoadBoard
from dynamo_prep.frontend.logprobs import Pacer, content_logprobs_for, paced, pacer_for
from dynamo_prep.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from dynamo_prep.frontend.migration import Migration, forked
from dynamo_prep.frontend.offload import off_loop_if_slow
from dynamo_prep.frontend.openai_stream import Completion, answer_deltas, sse
from dynamo_prep.frontend.request_record import CLIENT_GONE, RequestRecord
from dynamo_prep.frontend.responses import (
    ResponseBuilder,
    collect_response,
    read_request,
    response_events,
    responses_params,
)
from dynamo_prep.frontend.schema_checks import SchemaChecks
from dynamo_prep.preprocessor import stop_strings, validate_answer_budget, validate_n
from dynamo_prep.protocol.decode import decoding
from dynamo_prep.protocol.openai import (
    ChatCompletionRequest,
    DetokenizeResponse,
    ModelEntry,
    ModelList,
    RequestError,
    TokenizeResponse,
    TokenizeShell,
    decode_chat_shell,
    decode_detokenize,
    parse_chat_request,
)
from dynamo_prep.protocol.wire import Output
from dynamo_prep.routing.round_robin import RoundRobin
from dynamo_prep.routing.router import Router
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["create_app"]

log = structlog.get_logger("dynamo_prep.frontend")

# Preprocessing is sub-millisecond for ordinary prompts; bodies above this render and tokenize in a
# thread (~0.1 ms more), so one huge prompt cannot stall every other stream, nor /live, on the loop.
THREAD_ABOVE_BYTES = 32 << 10
# A stop string's character costs this many body bytes in that choice: the stop matcher's automaton
# takes ~0.7 us per character to build, so the largest stop list (16 Ki characters) builds in a thread.
STOP_CHAR_WEIGHT = 16
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,100}$")
_JSON = "application/json"
_T = TypeVar("_T")
_encoder = msgspec.json.Encoder()
# Request ids: this process's random prefix and a counter (as unique as a uuid4, without a syscall).
_PROCESS_ID = os.urandom(8).hex()
_sequence = itertools.count()


def create_app(
    catalog: ModelCatalog,
    client: RequestPlaneClient,
    *,
    router: Router | None = None,
    board: LoadBoard | None = None,
    settings: HttpSettings | None = None,
    metrics: FrontendMetrics | None = None,
    on_answered: Callable[[str], None] | None = None,
    schema_checks: SchemaChecks | None = None,
) -> ASGIApp:
    """The ASGI app serving ``catalog``'s live models through ``client``.

    ``router`` chooses each request's instance (else round robin); ``board`` holds the
    instances' load and the requests waiting for room (the watcher's; else a private one, which
    knows only this frontend's own requests). ``metrics`` is the
    frontend's own registry (shared with its watcher and router); without one the app gets a
    private registry, never prometheus_client's global one. ``on_answered`` is told a model's name
    when one of its workers answers a request (the watcher's ``model_answered``). ``schema_checks``
    checks requests' JSON schemas (the caller closes it; else the app makes its own).
    """
    metrics = metrics if metrics is not None else FrontendMetrics()
    settings = settings or HttpSettings()
    declarations = DeclarationPreprocessors(metrics.discovery)
    migration = Migration(
        catalog, router or RoundRobin(), client, declarations, board=board, on_answered=on_answered,
        schema_limits=settings.schema_limits,
    )  # fmt: skip
    schemas = schema_checks or SchemaChecks(settings.schema_limits, metrics)
    handlers = _Handlers(catalog, migration, settings, metrics, schemas)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
            Route("/v1/completions", handlers.completions, methods=["POST"]),
            Route("/v1/responses", handlers.responses, methods=["POST"]),
            Route("/v1/models", handlers.models, methods=["GET"]),
            Route("/tokenize", handlers.tokenize, methods=["POST"]),
            Route("/detokenize", handlers.detokenize, methods=["POST"]),
            Route("/health", handlers.health, methods=["GET"]),
            Route("/live", handlers.live, methods=["GET"]),
            Route("/metrics", handlers.metrics_text, methods=["GET"]),
        ],
        exception_handlers={
            HTTPException: _http_exception,
            **dict.fromkeys(REQUEST_ERRORS, _request_error),
            Exception: _unexpected,
        },
    )
    return _RequestId(app, metrics)


class _Handlers:
    def __init__(
        self,
        catalog: ModelCatalog,
        migration: Migration,
        settings: HttpSettings,
        metrics: FrontendMetrics,
        schemas: SchemaChecks,
    ) -> None:
        self.catalog = catalog
        self.migration = migration
        self.settings = settings
        self.metrics = metrics
        self.schemas = schemas

    # -- chat completions --------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = await _read_body(request, self.settings)
        chat = await _parse_chat(body)
        record: RequestRecord = request.state.record
        choices = await _firsts(await self._begin(request, body, chat, "chatcmpl-"))
        if len(choices) > 1:
            return await self._chat_choices(request, chat, choices)
        [choice] = choices
        completion = choice.completion
        if chat.stream:
            include_usage = bool((chat.stream_options or {}).get("include_usage"))
            return _EventStream(sse(choice.outputs, completion, record, include_usage=include_usage))
        async with contextlib.aclosing(choice.outputs):
            deltas = answer_deltas(choice.outputs, completion, record)
            await _unless_disconnected(request.receive, _drain(deltas))
        return Response(_encoder.encode(completion.response()), media_type=_JSON)

    async def _chat_choices(
        self, request: Request, chat: ChatCompletionRequest, choices: list[Choice]
    ) -> Response:
        """n > 1: the choices interleaved in one stream, or collected into one answer (``choices.py``)."""
        record: RequestRecord = request.state.record
        if chat.stream:
            include_usage = bool((chat.stream_options or {}).get("include_usage"))
            usage = (lambda: chat_usage_event(choices, record)) if include_usage else None
            streams = [chat_events(choice, record) for choice in choices]
            return _EventStream(merged_sse(streams, usage))
        await _unless_disconnected(request.receive, collect(choices, record))
        return Response(_encoder.encode(chat_response(choices, record)), media_type=_JSON)

    async def completions(self, request: Request) -> Response:
        """OpenAI's legacy completions: each prompt (n times) a request on the chat path (completions.py)."""
        body = await _read_body(request, self.settings)
        asked, prompts = await _off_loop(len(body), lambda: read_completion(body))
        record: RequestRecord = request.state.record
        chat = chat_of(asked)
        preprocessor = self._serving(record, chat.model).preprocessor
        begun: list[Choice] = []
        count = len(prompts) * chat.n
        pacer = pacer_for(chat, count)
        with completion_params():
            validate_answer_budget(chat, count, preprocessor.context_length)
            specials = asked.add_special_tokens
            for index, render in enumerate(renders(prompts, preprocessor, add_special_tokens=specials)):
                begun += await self._begin(
                    request, body, chat, "cmpl-", render=render, prompt_index=index, pacer=pacer
                )
        choices = await _firsts(begun)
        shaped = TextChoices(asked, choices, prompts, preprocessor.tokenizer, record)
        if asked.stream:
            return _EventStream(shaped.sse())
        answer = await _unless_disconnected(request.receive, shaped.answer())
        return Response(answer, media_type=_JSON)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the request as a chat request, served as one (``responses.py``)."""
        body = await _read_body(request, self.settings)
        asked, chat = await _off_loop(len(body), lambda: read_request(body))
        record: RequestRecord = request.state.record
        with responses_params():
            [choice] = await _firsts(await self._begin(request, body, chat, "resp_"))
        builder = ResponseBuilder(choice.completion, asked)
        if asked.stream:
            return _EventStream(response_events(choice.outputs, builder, record))
        async with contextlib.aclosing(choice.outputs):
            built = collect_response(choice.outputs, builder, record)
            answer = await _unless_disconnected(request.receive, built)
        return Response(_encoder.encode(answer), media_type=_JSON)

    def _serving(self, record: RequestRecord, name: str) -> LiveModel:
        """The live model asked for, named in the request's record."""
        if self.catalog.status(name) != "unknown":
            record.name_model(name)
        model = self._live_model(name)
        record.serving(model.name)
        structlog.contextvars.bind_contextvars(model=model.name)
        return model

    async def _begin(
        self,
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
        model = self._serving(record, chat.model)
        validate_n(chat.n)
        if render is None:
            validate_answer_budget(chat, chat.n, model.preprocessor.context_length)
            pacer = pacer_for(chat, chat.n)
            await self._check_schemas(request, chat, model)
        request_id: str = request.state.request_id
        # Unique on the request plane even when a client reuses its x-request-id.
        plane_id = f"{request_id}.{_PROCESS_ID[:8]}{next(_sequence):x}"
        journey = await self.migration.begin(
            model,
            msgspec.structs.replace(chat, n=1),
            request_id=plane_id,
            record=record,
            timeout_s=self.settings.request_timeout_s,
            in_thread=len(body) > THREAD_ABOVE_BYTES,
            render=render,
        )
        journeys = [journey]
        journeys += [forked(journey, f"{plane_id}.{i}", choice_seed(chat.seed, i)) for i in range(1, chat.n)]
        tokenizer, rendered = model.preprocessor.tokenizer, journey.prompt.rendered
        created = int(time.time())
        choices = []
        for i, each in enumerate(journeys):
            if render is None:
                answer = await _off_loop(
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
            outputs = _observed(self.migration.outputs(each), record)
            if pacer is not None:  # the choices' tokens rendered in slices, the loop turning between
                outputs = paced(outputs, pacer)
            choices.append(Choice(completion, outputs, prompt_index))
        return choices

    async def _check_schemas(self, request: Request, chat: ChatCompletionRequest, model: LiveModel) -> None:
        """The request's schemas bounded (on the loop: one linear pass within the limits), then checked
        against their metaschemas in the checker processes, the check stopped if the client leaves."""
        uses = model.preprocessor.schemas_to_check(chat, limits=self.settings.schema_limits)
        if uses:
            await _unless_disconnected(request.receive, self.schemas.check(uses))

    # -- models, tokenize, detokenize, health ------------------------------------------------

    async def models(self, request: Request) -> Response:
        del request
        entries = []
        for name in self.catalog.names():
            model = self.catalog.get(name)
            if model is not None:
                entries.append(ModelEntry(id=name, created=model.created))
        return Response(_encoder.encode(ModelList(data=entries)), media_type=_JSON)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``, rendered with the model's canonical declaration."""
        body = await _read_body(request, self.settings)
        with decoding(RequestError.of):  # the messages are skipped here: a chat is decoded as one
            tokenize = msgspec.json.decode(body, type=TokenizeShell)
        model = self._live_model(tokenize.model)
        preprocessor, tokenizer = model.preprocessor, model.preprocessor.tokenizer
        if tokenize.chat:
            chat = await _parse_chat(body)
            tokens = await _off_loop(len(body), lambda: preprocessor.tokenize(chat).token_ids)
            if tokenize.add_special_tokens:
                tokens = tokenizer.with_special_tokens(tokens)
        elif tokenize.prompt is not None:
            text, specials = tokenize.prompt, tokenize.add_special_tokens is not False
            tokens = await _off_loop(
                len(body), lambda: tokenizer.encode_prompt(text, add_special_tokens=specials)
            )
        else:
            raise OpenAIError(400, "give either messages (a chat) or prompt (text)", param="messages")
        strs = [tokenizer.id_to_token(t) or "" for t in tokens] if tokenize.return_token_strs else None
        answer = TokenizeResponse(
            count=len(tokens), max_model_len=preprocessor.context_length, tokens=tokens, token_strs=strs
        )
        return Response(_encoder.encode(answer), media_type=_JSON)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ids of the model's vocabulary back to text (specials as their text)."""
        body = await _read_body(request, self.settings)
        # a large body's ids are counted (refused past the limit), decoded and checked in a thread
        detokenize = await _off_loop(len(body), lambda: decode_detokenize(body))
        preprocessor = self._live_model(detokenize.model).preprocessor
        ids, tokenizer = detokenize.tokens, preprocessor.tokenizer

        def decoded() -> str:
            _check_ids(ids, preprocessor.context_length, tokenizer)
            return tokenizer.decode(ids)

        text = await _off_loop(len(body), decoded)
        return Response(_encoder.encode(DetokenizeResponse(prompt=text)), media_type=_JSON)

    async def health(self, request: Request) -> Response:
        """Readiness: 200 with the live models once one is servable, else 503."""
        del request
        names = self.catalog.names()
        body = {"status": "healthy" if names else "unhealthy", "models": names}
        return Response(_encoder.encode(body), status_code=200 if names else 503, media_type=_JSON)

    async def live(self, request: Request) -> Response:
        del request
        return Response(b'{"status":"live"}', media_type=_JSON)

    async def metrics_text(self, request: Request) -> Response:
        """Prometheus' scrape endpoint: this frontend's registry only."""
        del request
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    def _live_model(self, name: str) -> LiveModel:
        """The model if it can serve now; 503 while it (or every model) has no instance; else 404."""
        model = self.catalog.get(name)
        if model is not None:
            return model
        served = self.catalog.names()
        if self.catalog.status(name) == "pending":
            raise OpenAIError(503, f"model {name!r} has no live instance right now; retry shortly")
        if not served:
            raise OpenAIError(503, f"no model is being served right now (asked for {name!r})")
        raise OpenAIError(
            404, f"The model {name!r} does not exist. Served models: {', '.join(served)}", param="model"
        )


def _check_ids(ids: list[int], context_length: int, tokenizer: Tokenizer) -> None:
    """400s naming ``tokens``: more ids than the model's context holds, or one outside its vocabulary."""
    if len(ids) > context_length:
        raise OpenAIError(
            400, f"{len(ids)} tokens exceed the model's context length of {context_length}", param="tokens"
        )
    unknown = tokenizer.unknown_id_error(ids)
    if unknown is not None:
        raise OpenAIError(400, unknown, param="tokens")


_NO_CACHE = {"cache-control": "no-cache"}


async def _read_body(request: Request, settings: HttpSettings) -> bytes:
    """The body, refused with 413 past the size limit (by Content-Length, and as it streams in),
    with 408 when it takes longer than ``body_timeout_s``; a client leaving mid-upload is a 499."""
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"the request body took longer than {settings.body_timeout_s:g} s") from None
    except ClientDisconnect:
        raise OpenAIError(CLIENT_GONE, "client disconnected during the upload") from None
    return b"".join(chunks)


async def _parse_chat(body: bytes) -> ChatCompletionRequest:
    """The chat request; a large body's messages are decoded in a thread, a part at a time."""
    if len(body) <= THREAD_ABOVE_BYTES:
        return parse_chat_request(body)
    return await asyncio.to_thread(decode_chat_shell(body).finish)


async def _off_loop(size: int, work: Callable[[], _T]) -> _T:
    """``work()``, in a thread when the body is large or a render turns out slow (never long on the loop)."""
    return await off_loop_if_slow(work, in_thread=size > THREAD_ABOVE_BYTES)


async def _firsts(choices: list[Choice]) -> list[Choice]:
    """The choices with their first outputs in (awaited together): a failure up to here keeps its
    HTTP status, and closes every choice."""
    if len(choices) == 1:
        [choice] = choices
        first = await _first(choice.outputs)
        choice.outputs = _prepend(first, choice.outputs)
        return choices
    firsts = [asyncio.ensure_future(_first(choice.outputs)) for choice in choices]
    try:
        await asyncio.gather(*firsts)
    except BaseException:
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for choice in choices:
            await choice.outputs.aclose()
        raise
    for choice, task in zip(choices, firsts, strict=True):
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


async def _drain(items: AsyncGenerator[Any, None]) -> None:
    async with contextlib.aclosing(items):
        async for _ in items:
            pass


async def _unless_disconnected(receive: Receive, work: Awaitable[_T]) -> _T:
    """Await ``work``, cancelling it (and so the worker's generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        log.info("client_disconnected")
        raise OpenAIError(CLIENT_GONE, "client disconnected")
    return task.result()


class _EventStream(Response):
    """A ``text/event-stream`` response: each item of ``events`` is one body write, and a client
    that goes away cancels the stream (closing it cancels the generation on the worker); the
    response then never completes, which the request's record logs as 499."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(headers=_NO_CACHE)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            await _unless_disconnected(receive, self._pump(send))
        except OpenAIError:  # the client left: nobody to answer
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        async with contextlib.aclosing(self.events):
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        super().init_headers(headers)
        self.raw_headers = [(name, value) for name, value in self.raw_headers if name != b"content-length"]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _request_error(request: Request, exc: Exception) -> Response:
    """The error's answer; the ``request_failed`` line is written when the response is over."""
    error = as_openai_error(exc)
    _record_failure(request, error)
    return error_response(error)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("request_crashed", path=request.url.path, error=repr(exc))
    error = OpenAIError(500, "internal error")
    _record_failure(request, error)
    return error_response(error)


def _record_failure(request: Request, error: OpenAIError) -> None:
    record: RequestRecord | None = getattr(request.state, "record", None)
    if record is not None:
        record.fail(error.status, error.message)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    headers = dict(exc.headers or {})
    error = OpenAIError(exc.status_code, message)
    _record_failure(request, error)
    return error_response(error, headers=headers)


class _RequestId:
    """Pure ASGI middleware: choose the request id, expose it as ``request.state.request_id``,
    echo it in ``x-request-id``, keep the request's ``RequestRecord`` in ``request.state.record``
    and close it (log line + metrics) when the response is over; unbind the logging context."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        record = RequestRecord(request_id, scope.get("path", ""), self.metrics)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["record"] = record
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())
        response: dict[str, Any] = {"status": None, "complete": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
                response["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["complete"] = True
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                record.finish(response["status"], body_complete=response["complete"])


def _request_id(scope: Scope) -> str:
    """An incoming ``x-request-id`` when it is a sane token, else a fresh one."""
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER.encode():
            text = bytes(value).decode("latin-1")
            if _REQUEST_ID.match(text):
                return text
    return f"{_PROCESS_ID}{next(_sequence):016x}"
