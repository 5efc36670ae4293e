"""A GPU-free engine, like Dynamo's mocker, that enforces a real engine's image contract.

The mock exists to make a wrong image placeholder loud: it checks the token ids it receives
exactly the way SGLang or vLLM would (``flavor``) and rejects a mismatch with the engine's own
wording, instead of generating from a prompt the real engine would refuse or misread.

It then streams a deterministic reply, one token per output, until a stop id (never emitted),
a stop string or ``max_tokens``: under a structured-output constraint, an instance of its schema
(``instance``); else the first scripted reply (``replies``, a JSON Lines file; see
``mock_replies``) whose ``when`` occurs in the last user message, else the echo of what it
received (``[mock FLAVOR] N image(s), M prompt tokens. You said: ...``). With
``reply_format="model"`` the echo is written in the model's own answer format (``answer``):
a short think channel when the prompt ends in one, the echo as the response, a call of the first
declared tool when the user spoke last, and after tool results a plain answer saying what they
returned. Everything is read from the prompt's ids (``prompt``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import NamedTuple, NoReturn

import msgspec
import structlog

from dynamo_prep.engines.base import (
    DEFAULT_REPLY_FORMAT,
    REPLY_FORMATS,
    EngineContractError,
    ReplyFormat,
)
from dynamo_prep.engines.bridge import EmulatedContract
from dynamo_prep.engines.mock.answer import AnswerWriter, ToolCall, schema_arguments
from dynamo_prep.engines.mock.instance import instance_of
from dynamo_prep.engines.mock.logprobs import mock_logprob
from dynamo_prep.engines.mock.prompt import PromptReader, PromptView, count_occurrences
from dynamo_prep.engines.mock.replies import load_replies, matching_reply
from dynamo_prep.engines.registry import emulated
from dynamo_prep.engines.steps import logprobs_asked
from dynamo_prep.formatter import is_kimi_k3
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.preprocessed import PreprocessedRequest, StopConditions, StructuredOutput
from dynamo_prep.protocol.wire import TokenLogprob
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["NO_PREFILL", "MockContinuation", "MockEngine", "MockOutput", "Prefill"]

log = structlog.get_logger("dynamo_prep.engines")

MAX_ECHO_CHARS = 200
MAX_CONTINUATION_TOKENS = 4096
# A structured answer is built to at most this many characters per token of ``max_tokens`` (JSON
# averages 3-4 characters a token here), then tokenized and cut at ``max_tokens`` like any answer:
# a schema asking for 30,000,000 characters costs what ``max_tokens`` allows, no more.
INSTANCE_CHARS_PER_TOKEN = 8


class MockOutput(msgspec.Struct, frozen=True):
    """One streamed step: one token id (none only for an empty reply); the last one has a finish
    reason; ``logprobs`` the token's (``logprobs``) when the request asked for them."""

    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


class Prefill(NamedTuple):
    """What a request's prefill costs: the prompt tokens reused from a prefix cache, and the delay
    charged (before the first token) for the rest."""

    cached_tokens: int = 0
    seconds: float = 0.0


NO_PREFILL = Prefill()


class MockEngine:
    """Checks a ``PreprocessedRequest`` against SGLang's or vLLM's contract and streams a reply."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        flavor: str,
        token_delay_s: float = 0.0,
        replies: str | Path | None = None,
        reply_format: ReplyFormat = DEFAULT_REPLY_FORMAT,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """Raises ValueError for a bad option, ``RepliesError`` (a ValueError) for a bad replies file.

        ``tool_call_parser`` / ``reasoning_parser``: the worker's declared parsers (vLLM's names); a
        model-format answer is written in the declared tool-call format when the mock has a writer for
        it (``answer.BODIES``, ``answer.WHOLE_ANSWERS``)."""
        contract = emulated(flavor).emulate
        if token_delay_s < 0:
            raise ValueError(f"token_delay_s must be >= 0, got {token_delay_s}")
        if reply_format not in REPLY_FORMATS:
            raise ValueError(f"unknown reply format {reply_format!r} (known: {', '.join(REPLY_FORMATS)})")
        self.model_dir = resolve_model_dir(model_dir)
        self.flavor = flavor
        self.token_delay_s = token_delay_s
        self.reply_format: ReplyFormat = reply_format
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.name = self.tokenizer.name
        self.replies = load_replies(replies, self.tokenizer) if replies is not None else ()
        assert contract is not None  # emulated() returns only engines the mock can emulate
        self._contract: EmulatedContract = contract(self.model_dir, self.tokenizer)
        kimi_k3 = is_kimi_k3(self.tokenizer.model_type, self.name)
        self._reader = PromptReader(self.tokenizer, kimi_k3=kimi_k3, strip=self._contract.strip)
        self._answers = AnswerWriter(
            self.tokenizer,
            self._reader.family,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )

    @property
    def declared_image_token(self) -> str | None:
        """What a worker running the emulated engine declares in its card (vLLM: nothing)."""
        return self._contract.declared_image_token

    @property
    def image_pattern(self) -> tuple[int, ...] | None:
        """The id sequence that stands for one image in a prompt, as the engine counts it (None: the
        model takes no images)."""
        return self._contract.pattern

    def check_contract(self, request: PreprocessedRequest) -> None:
        """Raise ``EngineContractError`` when the prompt's image placeholders do not match its images."""
        expected = len(request.images)
        if self._contract.pattern is None:
            if expected:
                self._violation(
                    expected=0,
                    found=expected,
                    message=f"{self.name} takes no images under {self.flavor} (no multimodal processor); "
                    f"the request has {expected} image(s)",
                )
            return
        found = count_occurrences(request.token_ids, self._contract.pattern)
        if found == expected:
            return
        self._violation(expected=expected, found=found, message=self._contract.mismatch(expected, found))

    async def generate(
        self, request: PreprocessedRequest, *, prefill: Prefill = NO_PREFILL
    ) -> AsyncIterator[MockOutput]:
        """Stream the reply one token per output; raises ``EngineContractError`` before any output.

        Cancellation is honoured at every token (``asyncio.sleep`` even with no delay). A
        structured answer is planned in a thread: building it takes up to ~0.5 s at the largest
        ``max_tokens`` (``INSTANCE_CHARS_PER_TOKEN``), which the worker's loop must not wait for.
        """
        self.check_contract(request)
        if request.sampling_options.structured is not None:
            token_ids, finish_reason = await asyncio.to_thread(self.plan, request, prefill=prefill)
        else:
            token_ids, finish_reason = self.plan(request, prefill=prefill)
        prompt_tokens = len(request.token_ids)
        async for step in self.stream(
            token_ids, finish_reason, prompt_tokens, prefill=prefill, logprobs=logprobs_asked(request)
        ):
            yield step

    async def stream(
        self,
        token_ids: Sequence[int],
        finish_reason: str,
        prompt_tokens: int,
        *,
        prefill: Prefill = NO_PREFILL,
        logprobs: int | None = None,
        first_position: int = 0,
    ) -> AsyncIterator[MockOutput]:
        """``token_ids`` one per output, ``token_delay_s`` apart, the first after the prefill's
        ``seconds`` more; the last output has ``finish_reason``; each reports the prefill's cache hits,
        and with ``logprobs`` (top k) its token's (``mock_logprob`` at ``first_position`` + its index)."""
        cached = prefill.cached_tokens
        n_vocab = self.tokenizer.n_vocab
        try:
            if prefill.seconds > 0:
                await asyncio.sleep(prefill.seconds)
            if not token_ids:
                yield MockOutput([], finish_reason, prompt_tokens, 0, cached)
                return
            for index, token_id in enumerate(token_ids, start=1):
                await asyncio.sleep(self.token_delay_s)
                last = index == len(token_ids)
                records = (
                    None
                    if logprobs is None
                    else [mock_logprob(token_id, first_position + index - 1, logprobs, n_vocab)]
                )
                reason = finish_reason if last else None
                yield MockOutput([token_id], reason, prompt_tokens, index, cached, records)
        except asyncio.CancelledError:
            log.debug("mock_generate_cancelled", flavor=self.flavor, prompt_tokens=prompt_tokens)
            raise

    def plan(
        self, request: PreprocessedRequest, *, streamed: int = 0, prefill: Prefill = NO_PREFILL
    ) -> tuple[list[int], str]:
        """The reply as it will stream (stop conditions applied) and its finish reason; logged
        (``streamed``: how many of its tokens a migrated request already carries; ``prefill``: what
        its prefill reuses and costs)."""
        token_ids, source = self._reply(request)
        token_ids, finish_reason = self._limit(token_ids, request.stop_conditions)
        log.debug(
            "mock_generate_started",
            flavor=self.flavor,
            reply=source,
            images=len(request.images),
            prompt_tokens=len(request.token_ids),
            completion_tokens=len(token_ids),
            streamed=streamed,
            cached_tokens=prefill.cached_tokens,
            prefill_ms=round(prefill.seconds * 1000, 3),
        )
        return token_ids, finish_reason

    def reply_ids(self, request: PreprocessedRequest) -> list[int]:
        """The whole reply, before stop conditions: scripted, else the echo (in the model's format)."""
        return self._reply(request)[0]

    def _reply(self, request: PreprocessedRequest) -> tuple[list[int], str]:
        """``reply_ids`` and where they come from (``scripted:LINE``, ``echo`` or ``model``)."""
        view = self._reader.read(request.token_ids)
        structured = request.sampling_options.structured
        if structured is not None:
            return self._constrained(view, structured, request.stop_conditions.max_tokens), "structured"
        scripted = matching_reply(self.replies, view.last_user)
        if scripted is not None:
            return list(scripted.token_ids), f"scripted:{scripted.line}"
        echo = self._echo(request, view)
        if self.reply_format == "echo":
            return self.tokenizer.encode(echo), "echo"
        return self._model_answer(view, echo), "model"

    def _constrained(self, view: PromptView, structured: StructuredOutput, max_tokens: int) -> list[int]:
        """What a grammar would allow: an instance of the schema (``{}`` for a JSON object) as the
        content, in the model's format (its reasoning stays free, as with an engine's reasoning
        parser); no more of it than ``max_tokens`` can hold."""
        schema = {"type": "object"} if structured.json_schema is None else json.loads(structured.json_schema)
        budget = max(max_tokens, 1) * INSTANCE_CHARS_PER_TOKEN
        text = json.dumps(instance_of(schema, max_chars=budget), ensure_ascii=False)
        if self.reply_format == "echo":
            return self.tokenizer.encode(text)
        return self._answers.write(view, reasoning="I will answer in JSON.", content=text, call=None)

    def reply_text(self, request: PreprocessedRequest) -> str:
        """``reply_ids`` as text (specials spelled out)."""
        return self.tokenizer.decode(self.reply_ids(request))

    def generation_points(self, token_ids: Sequence[int]) -> list[int] | None:
        """Where in ``token_ids`` a completion may have started, latest first (None: unknown format)."""
        return self._reader.generation_points(token_ids)

    def _echo(self, request: PreprocessedRequest, view: PromptView) -> str:
        """What arrived, and the last user text echoed back (at most 200 characters)."""
        said = view.last_user[-MAX_ECHO_CHARS:] if view.family == "plain" else view.last_user
        return (
            f"[mock {self.flavor}] {len(request.images)} image(s), "
            f"{len(request.token_ids)} prompt tokens. You said: {_clip(said)}"
        )

    def _model_answer(self, view: PromptView, echo: str) -> list[int]:
        """After tool results: what they returned. Else the echo, calling the first declared tool
        when the user spoke last (unless ``tool_choice`` is ``none``)."""
        if view.last_role == "tool":
            returned = "; ".join(
                f"{result.name or 'the tool'} returned: {_clip(result.text)}" for result in view.tool_results
            )
            content = f"[mock {self.flavor}] {returned or 'the tool returned nothing'}"
            reasoning = "The tool answered; I will say what it returned."
            return self._answers.write(view, reasoning=reasoning, content=content, call=None)
        call = None
        if view.tools and view.last_role == "user" and view.tool_choice != "none":
            tool = view.tools[0]
            call = ToolCall(tool.name, schema_arguments(tool))
        reasoning = f"I will call {call.name}." if call is not None else "I will echo the last user message."
        return self._answers.write(view, reasoning=reasoning, content=echo, call=call)

    def _limit(self, token_ids: list[int], stop: StopConditions) -> tuple[list[int], str]:
        """Cut at a stop id or stop string (never emitted), then at ``max_tokens`` ("length")."""
        token_ids = _cut_at_stop_ids(token_ids, {*stop.stop_token_ids, *stop.stop_token_ids_hidden})
        token_ids = self._cut_at_stop_strings(token_ids, stop.stop)
        if len(token_ids) > stop.max_tokens:
            return token_ids[: max(stop.max_tokens, 0)], "length"
        return token_ids, "stop"

    def _cut_at_stop_strings(self, token_ids: list[int], stops: Sequence[str]) -> list[int]:
        """The tokens whose text ends before the first stop string, as a real engine's stop check
        over the decoded text so far would leave them (a token straddling the stop is dropped)."""
        text = self.tokenizer.decode(token_ids)
        hits = [text.find(stop) for stop in stops if stop and stop in text]
        if not hits:
            return token_ids
        budget = len(text[: min(hits)].encode("utf-8"))
        kept = 0
        for token_id in token_ids:
            budget -= len(self.tokenizer.token_bytes(token_id))
            if budget < 0:
                break
            kept += 1
        return token_ids[:kept]

    def _violation(self, *, expected: int, found: int, message: str) -> NoReturn:
        log.warning(
            "mock_contract_violation", flavor=self.flavor, model=self.name, expected=expected, found=found
        )
        raise EngineContractError(message)


def _cut_at_stop_ids(token_ids: list[int], stop_ids: set[int]) -> list[int]:
    for index, token_id in enumerate(token_ids):
        if token_id in stop_ids:
            return token_ids[:index]
    return token_ids


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


class MockContinuation:
    """The mock engine, continuing a migrated request the way a real engine would.

    A migrated request's prompt is the original prompt followed by the tokens already streamed
    (Dynamo's migration). A real LLM simply continues that text; the mock's reply is a function
    of the prompt, so it looks for the point where its own reply began (where the prompt's
    assistant turn opens, latest first) and streams the rest of that reply. A prompt that ends
    right at such a point is new. A hosted K3 prompt whose channel opener was streamed reads as
    the reference prompt it then equals.
    """

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        first_ids = [reply.token_ids[0] for reply in engine.replies if reply.token_ids]
        # For a prompt of unknown format: the ids a reply can start with (scripted, or the echo).
        self._first_ids = frozenset([*first_ids, engine.tokenizer.encode(f"[mock {engine.flavor}]")[0]])

    def check_contract(self, request: PreprocessedRequest) -> None:
        self.engine.check_contract(request)

    async def generate(
        self, request: PreprocessedRequest, *, prefill: Prefill = NO_PREFILL
    ) -> AsyncIterator[MockOutput]:
        streamed = self.already_streamed(request)
        if not streamed:
            async for step in self.engine.generate(request, prefill=prefill):
                yield step
            return
        shortened = _shortened(request, streamed)
        token_ids, finish_reason = self.engine.plan(shortened, streamed=streamed, prefill=prefill)
        remaining = token_ids[streamed:]
        async for step in self.engine.stream(
            remaining,
            finish_reason,
            len(request.token_ids),
            prefill=prefill,
            logprobs=logprobs_asked(request),
            first_position=streamed,
        ):
            yield step

    def already_streamed(self, request: PreprocessedRequest) -> int:
        """How many trailing prompt tokens are the start of the mock's reply to the rest (0: none)."""
        ids = request.token_ids
        low = max(1, len(ids) - MAX_CONTINUATION_TOKENS)
        points = self.engine.generation_points(ids)
        if points is None:
            points = [start for start in range(len(ids) - 1, low - 1, -1) if ids[start] in self._first_ids]
        for start in points:
            if start >= len(ids):
                return 0
            if start < low:
                continue
            tail = ids[start:]
            if self.engine.reply_ids(_shortened(request, len(tail)))[: len(tail)] == tail:
                return len(tail)
        return 0


def _shortened(request: PreprocessedRequest, streamed: int) -> PreprocessedRequest:
    """The request before migration: without the streamed tail, with its original token budget."""
    stop = msgspec.structs.replace(
        request.stop_conditions, max_tokens=request.stop_conditions.max_tokens + streamed
    )
    return msgspec.structs.replace(request, token_ids=request.token_ids[:-streamed], stop_conditions=stop)
