"""OpenAI's legacy completions over the chat path: each prompt becomes a chat request whose prompt is
the client's own text or ids (no template: ``preprocess_ids``), served by the same pool, migration,
routing and records; the answer is plain text (no reasoning or tool parsing), shaped as
``text_completion`` objects or their SSE chunks. What is served and refused: docs/frontend.md
"Completions".
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence

import msgspec

from dynamo_prep.frontend.answers import AnswerStream
from dynamo_prep.frontend.choices import Choice, all_or_none, merged_sse, summed_usage
from dynamo_prep.frontend.logprobs import SLOT, LegacyLogprobs, slotted
from dynamo_prep.frontend.openai_stream import answer_deltas
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.parsing import ContentDelta, plain_parser_for
from dynamo_prep.preprocessor import (
    MAX_CHOICES,
    OpenAIPreprocessor,
    PreprocessedRequest,
    PreprocessError,
    TokenizedPrompt,
    stop_strings,
    validate_n,
)
from dynamo_prep.protocol.completions import (
    DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Prompt,
    parse_completion_request,
    prompts_of,
)
from dynamo_prep.protocol.openai import ChatCompletionRequest, RequestError
from dynamo_prep.protocol.wire import Output
from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "Render",
    "TextChoices",
    "chat_of",
    "plain_answer",
    "read_completion",
    "renders",
]

Render = Callable[[ChatCompletionRequest], tuple[PreprocessedRequest, TokenizedPrompt]]
_encoder = msgspec.json.Encoder()


def read_completion(body: bytes) -> tuple[CompletionRequest, list[Prompt]]:
    """The body decoded and its prompts; what cannot be served is refused naming the parameter."""
    asked = parse_completion_request(body)
    prompts = prompts_of(asked.prompt)
    if asked.suffix:
        raise RequestError("suffix is not supported (no insertion mode): leave it out", param="suffix")
    if asked.best_of is not None and asked.best_of not in (1, asked.n):
        raise RequestError(
            f"best_of must be 1 or n ({asked.n}): choices are not ranked here, got {asked.best_of}",
            param="best_of",
        )
    if asked.echo and asked.logprobs is not None:
        raise RequestError(
            "echo with logprobs is not supported: the engines return no prompt logprobs here; "
            "leave out echo or logprobs",
            param="echo",
        )
    validate_n(asked.n)
    if len(prompts) * asked.n > MAX_CHOICES:
        raise RequestError(
            f"{len(prompts)} prompts x n={asked.n} is more than {MAX_CHOICES} choices: send fewer prompts",
            param="prompt",
        )
    return asked, prompts


def chat_of(asked: CompletionRequest) -> ChatCompletionRequest:
    """The chat request carrying ``asked``'s options (its prompt is rendered by ``renders``)."""
    return ChatCompletionRequest(
        model=asked.model,
        messages=[],
        max_tokens=DEFAULT_MAX_TOKENS if asked.max_tokens is None else asked.max_tokens,
        min_tokens=asked.min_tokens,
        temperature=asked.temperature,
        top_p=asked.top_p,
        top_k=asked.top_k,
        seed=asked.seed,
        presence_penalty=asked.presence_penalty,
        frequency_penalty=asked.frequency_penalty,
        repetition_penalty=asked.repetition_penalty,
        stop=asked.stop,
        stop_token_ids=asked.stop_token_ids,
        logit_bias=asked.logit_bias,
        ignore_eos=asked.ignore_eos,
        n=asked.n,
        logprobs=asked.logprobs is not None,
        top_logprobs=asked.logprobs,
        user=asked.user,
    )


def renders(
    prompts: Sequence[Prompt], preprocessor: OpenAIPreprocessor, *, add_special_tokens: bool
) -> list[Render]:
    """Each prompt's render: its text tokenized as the model's tokenizer encodes a prompt (special-token
    text is the special token; ``add_special_tokens``: a BOS where the tokenizer adds one) or its ids
    checked against the vocabulary; the context is checked by ``preprocess_ids``."""
    return [_render(prompt, preprocessor, add_special_tokens) for prompt in prompts]


def _render(prompt: Prompt, preprocessor: OpenAIPreprocessor, add_special_tokens: bool) -> Render:
    def render(chat: ChatCompletionRequest) -> tuple[PreprocessedRequest, TokenizedPrompt]:
        ids, text = _tokenized(prompt, preprocessor.tokenizer, add_special_tokens)
        return preprocessor.preprocess_ids(chat, ids, text)

    return render


def _tokenized(prompt: Prompt, tokenizer: Tokenizer, add_special_tokens: bool) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        ids = tokenizer.encode_prompt(prompt, add_special_tokens=add_special_tokens)
        text = prompt
    else:
        unknown = tokenizer.unknown_id_error(prompt)
        if unknown is not None:
            raise PreprocessError(unknown, param="prompt")
        ids, text = prompt, tokenizer.decode(prompt)
    if not ids:
        raise PreprocessError("prompt must not be empty", param="prompt")
    return ids, text


def plain_answer(tokenizer: Tokenizer, chat: ChatCompletionRequest) -> AnswerStream:
    """The answer as plain text: every decoded token is text (specials are not), stop strings end it."""
    return AnswerStream(plain_parser_for(tokenizer), stops=stop_strings(chat.stop))


class TextChoices:
    """Completions' shapes of the choices' answers: ``echo``'d prompt text first, ``logprobs`` of
    every generated token (``LegacyLogprobs``)."""

    def __init__(
        self,
        asked: CompletionRequest,
        choices: Sequence[Choice],
        prompts: Sequence[Prompt],
        tokenizer: Tokenizer,
        record: RequestRecord,
    ) -> None:
        self.asked = asked
        self.choices = choices
        self.echoes = [_text_of(prompt, tokenizer) if asked.echo else "" for prompt in prompts]
        self.tokenizer = tokenizer
        self.record = record
        first = choices[0].completion
        self.id, self.created, self.model = first.id, first.created, first.model

    def sse(self) -> AsyncGenerator[bytes, None]:
        """The streamed answer: every choice's chunks interleaved, usage when asked, ``[DONE]``."""
        include_usage = bool((self.asked.stream_options or {}).get("include_usage"))
        usage = self.usage_event if include_usage else None
        return merged_sse([self.events(choice) for choice in self.choices], usage)

    async def answer(self) -> list[bytes]:
        """The non-streamed answer (every choice collected together), in the pieces it is written in."""
        collected: list[tuple[CompletionChoice, bytes | None]] = []

        async def one(choice: Choice) -> None:
            collected.append(await self.collect(choice))

        await all_or_none([one(choice) for choice in self.choices])
        return self.response(collected)

    def _logprobs(self) -> LegacyLogprobs | None:
        top = self.asked.logprobs
        return None if top is None else LegacyLogprobs(self.tokenizer, top)

    async def collect(self, choice: Choice) -> tuple[CompletionChoice, bytes | None]:
        """One choice's whole answer, its ``logprobs`` a ``SLOT`` for their JSON (kept step by step,
        beside it)."""
        logprobs = self._logprobs()
        texts = [self.echoes[choice.prompt_index]]
        async for text, output in self._steps(choice, self.record):
            texts.append(text)
            if logprobs is not None:
                logprobs.keep(logprobs.render(output.token_ids, output.logprobs))
        kept = logprobs.kept() if logprobs is not None else None
        shaped = CompletionChoice(
            index=choice.completion.index,
            text="".join(texts),
            logprobs=None if kept is None else SLOT,
            finish_reason=choice.completion.finish_reason,
        )
        return shaped, kept

    def response(self, collected: list[tuple[CompletionChoice, bytes | None]]) -> list[bytes]:
        collected.sort(key=lambda pair: pair[0].index)
        usage = summed_usage(self.choices, self.record)
        shaped = [choice for choice, _ in collected]
        answer = CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=shaped, usage=usage
        )
        return slotted(_encoder.encode(answer), [kept for _, kept in collected if kept is not None])

    async def events(self, choice: Choice) -> AsyncGenerator[bytes, None]:
        """One choice's SSE events: the echo first, a chunk per step with text (or logprobs), the finish."""
        index, logprobs = choice.completion.index, self._logprobs()
        echo = self.echoes[choice.prompt_index]
        if echo:
            yield self._chunk(CompletionChoice(index=index, text=echo))
        async for text, output in self._steps(choice, self.record):
            rendered = None if logprobs is None else logprobs.render(output.token_ids, output.logprobs)
            if text or (rendered is not None and rendered.tokens):
                yield self._chunk(CompletionChoice(index=index, text=text, logprobs=rendered))
        finish = choice.completion.finish_reason
        yield self._chunk(CompletionChoice(index=index, text="", finish_reason=finish))

    def usage_event(self) -> bytes:
        usage = summed_usage(self.choices, self.record)
        chunk = CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return b"data: " + _encoder.encode(chunk) + b"\n\n"

    def _chunk(self, choice: CompletionChoice) -> bytes:
        chunk = CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        return b"data: " + _encoder.encode(chunk) + b"\n\n"

    @staticmethod
    async def _steps(choice: Choice, record: RequestRecord) -> AsyncGenerator[tuple[str, Output], None]:
        """Each worker output's text (stop strings honoured) with the output itself."""
        seen: list[Output] = []

        async def tapped() -> AsyncGenerator[Output, None]:
            async with contextlib.aclosing(choice.outputs):
                async for output in choice.outputs:
                    seen.append(output)
                    yield output

        async with contextlib.aclosing(tapped()) as outputs:
            async for deltas in answer_deltas(outputs, choice.completion, record):
                text = "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
                yield text, seen.pop()


def _text_of(prompt: Prompt, tokenizer: Tokenizer) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
