"""OpenAI chat request -> token ids: render with the formatter, tokenize, check the limits.

The frontend builds the formatter and the tokenizer separately and joins them with
``OpenAIPreprocessor.new_with_parts``; ``new`` is the convenience path from a model directory.
Every error a client can cause is a ``PreprocessError`` (HTTP 400) with a message that says
what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from dynamo_prep.card import ModelDeploymentCard, read_json
from dynamo_prep.formatter import (
    IMAGE_PART_TYPES,
    PromptFormatter,
    PromptRenderError,
    RenderedPrompt,
    collect_images,
    prompt_formatter_for,
)
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.openai import ChatCompletionRequest, RequestError, parse_chat_request
from dynamo_prep.protocol.preprocessed import (
    ImageRef,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
)
from dynamo_prep.protocol.schema_bounds import SchemaLimits
from dynamo_prep.protocol.structured import (
    DEFAULT_SCHEMA_LIMITS,
    SchemaUse,
    StructuredOutputError,
    TokenBudget,
    request_schemas,
    structured_output,
)
from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "MAX_ANSWER_ENTRIES",
    "MAX_CHOICES",
    "MAX_IMAGES_PER_REQUEST",
    "MAX_N",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "OpenAIPreprocessor",
    "PreprocessError",
    "PreprocessedRequest",
    "TokenizedPrompt",
    "entries_per_token",
    "stop_strings",
    "validate_answer_budget",
    "validate_n",
]

log = structlog.get_logger("dynamo_prep.preprocessor")

TOOL_CHOICE_STRINGS = frozenset({"none", "auto", "required"})
ANNOTATIONS = frozenset({"formatted_prompt", "token_ids"})
# Stop strings are matched on every output token, here and by the engine: bounded like TGI's
# --max-stop-sequences, but looser than OpenAI's 4 (self-hosted clients send a few more).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# The most alternatives a client may ask per token (OpenAI's bound; vLLM's default max_logprobs is 20).
MAX_TOP_LOGPROBS = 20
# vLLM V1's default --limit-mm-per-prompt (999 per modality): no prompt an engine takes by default
# is refused, and every per-image cost (identity hashes, routing extras) stays bounded per request.
MAX_IMAGES_PER_REQUEST = 999
# Choices per request: each is an engine request of its own (docs/frontend.md "n"), so n is bounded
# below OpenAI's 128; a batch of completions prompts gives prompts x n choices, at most MAX_CHOICES.
MAX_N = 16
MAX_CHOICES = 128
# What a request's choices together may make the frontend render and hold: each answer token is
# one entry, and with logprobs two more plus one per alternative. A single choice is bounded by
# the context alone, as in every engine; several together by this (docs/hostile-input.md, "Answers").
MAX_ANSWER_ENTRIES = 1 << 22


class PreprocessError(ValueError):
    """A request the model cannot take as sent (HTTP 400, OpenAI ``invalid_request_error``)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class TokenizedPrompt(msgspec.Struct, frozen=True):
    """A rendered prompt with its token ids and the request's images, in prompt order."""

    rendered: RenderedPrompt
    token_ids: list[int]
    images: list[ImageRef]


class OpenAIPreprocessor:
    """Renders and tokenizes chat requests for one model (one formatter, one tokenizer)."""

    def __init__(self, card: ModelDeploymentCard, formatter: PromptFormatter, tokenizer: Tokenizer) -> None:
        self.card = card
        self.formatter = formatter
        self.tokenizer = tokenizer
        self.mdcsum = card.mdcsum()
        self.context_length = card.runtime_config.context_length or card.context_length
        # The most characters one token spells: what bounds a structured answer's length.
        self.chars_per_token = tokenizer.longest_token_bytes
        # Set by ``new_with_parts`` when it warned: lets a metrics hook count the warning.
        self.unregistered_image_token: str | None = None

    @classmethod
    def new(cls, card: ModelDeploymentCard, model_dir: str | Path) -> OpenAIPreprocessor:
        """Formatter and tokenizer from the model directory, joined by ``new_with_parts``.

        The directory is resolved and its ``config.json`` read once, for both parts.
        """
        directory = resolve_model_dir(model_dir)
        config = read_json(directory / "config.json")
        token = card.runtime_config.image_placeholder_token
        formatter = prompt_formatter_for(card, directory, config=config, image_placeholder_token=token)
        return cls.new_with_parts(card, formatter, Tokenizer.from_model_dir(directory, config=config))

    @classmethod
    def new_with_parts(
        cls, card: ModelDeploymentCard, formatter: PromptFormatter, tokenizer: Tokenizer
    ) -> OpenAIPreprocessor:
        """Join separately built parts; warn once if the declared image token is not registered (it
        would shatter into several BPE ids)."""
        declared = card.runtime_config.image_placeholder_token
        unregistered = declared if declared is not None and not tokenizer.is_registered(declared) else None
        if unregistered is not None:
            log.warning(
                "declared_image_token_unregistered",
                model=card.display_name,
                token=unregistered,
                ids=tokenizer.encode(unregistered, allow_special=True),
                rendered=formatter.rendered_token == unregistered,
                formatter=formatter.kind,
            )
        preprocessor = cls(card, formatter.with_tokenizer_specials(tokenizer.special_tokens), tokenizer)
        preprocessor.unregistered_image_token = unregistered
        return preprocessor

    def tokenize(self, request: ChatCompletionRequest | dict[str, Any] | bytes) -> TokenizedPrompt:
        """Render and tokenize a request (segment by segment when the formatter segments)."""
        chat = _parse(request)
        validate_image_count(chat.messages)
        try:
            images = collect_images(chat.messages)
        except PromptRenderError as exc:
            raise PreprocessError(str(exc), param="messages") from exc
        validate_tool_choice(chat)
        try:
            rendered = self.formatter.render(chat)
        except PromptRenderError as exc:
            raise PreprocessError(str(exc), param=exc.param or "messages") from exc
        if rendered.image_count != len(images):
            raise PreprocessError(
                f"The request has {len(images)} image part(s) but the prompt rendered "
                f"{rendered.image_count} image placeholder(s); this model's template cannot place them.",
                param="messages",
            )
        if rendered.pieces is not None:
            token_ids = self.tokenizer.encode_pieces(rendered.pieces)
        else:
            token_ids = self.tokenizer.encode(rendered.text, allow_special=True)
        return TokenizedPrompt(rendered=rendered, token_ids=token_ids, images=images)

    def preprocess(
        self,
        request: ChatCompletionRequest | dict[str, Any] | bytes,
        *,
        limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS,
        metaschema: bool = True,
    ) -> PreprocessedRequest:
        """An OpenAI chat completion request as a ``PreprocessedRequest`` for a worker."""
        return self.preprocess_prompt(request, limits=limits, metaschema=metaschema)[0]

    def preprocess_prompt(
        self,
        request: ChatCompletionRequest | dict[str, Any] | bytes,
        *,
        limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS,
        metaschema: bool = True,
    ) -> tuple[PreprocessedRequest, TokenizedPrompt]:
        """``preprocess``, and the prompt it sent (where it left the model: ``rendered.open_channel``).

        Schemas are bounded by ``limits``; ``metaschema=False``: the caller checked
        ``schemas_to_check`` against their metaschemas (the frontend does, in processes of its own)."""
        chat = _parse(request)
        validate_sampling(chat)
        self._check_stop_ids(chat)
        validate_tool_choice(chat)
        structured = constraint_of(chat, self.token_budget(chat), limits=limits, metaschema=metaschema)
        prompt = self.tokenize(chat)
        return self._preprocessed(chat, prompt, structured), prompt

    def schemas_to_check(
        self, request: ChatCompletionRequest, *, limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS
    ) -> list[SchemaUse]:
        """The request's schemas, bounded (a refusal is a ``PreprocessError``), for a metaschema check."""
        validate_tool_choice(request)
        try:
            return request_schemas(
                request.response_format,
                request.tools,
                request.tool_choice,
                parallel_tool_calls=request.parallel_tool_calls,
                budget=self.token_budget(request),
                limits=limits,
            )
        except StructuredOutputError as exc:
            raise PreprocessError(str(exc), param=exc.param) from exc

    def token_budget(self, chat: ChatCompletionRequest) -> TokenBudget:
        """What the answer can spell: ``max_tokens`` tokens, or the whole context when it is not set."""
        requested = chat.requested_max_tokens
        if requested is not None and 0 < requested < self.context_length:
            return TokenBudget(requested, self.chars_per_token)
        return TokenBudget(self.context_length, self.chars_per_token, "the model's context length")

    def preprocess_ids(
        self, chat: ChatCompletionRequest, token_ids: list[int], text: str
    ) -> tuple[PreprocessedRequest, TokenizedPrompt]:
        """A prompt already tokenized (``/v1/completions``: no template); ``chat`` carries its options."""
        validate_sampling(chat)
        self._check_stop_ids(chat)
        prompt = TokenizedPrompt(rendered=RenderedPrompt(text=text), token_ids=token_ids, images=[])
        return self._preprocessed(chat, prompt, None), prompt

    def _check_stop_ids(self, chat: ChatCompletionRequest) -> None:
        """Stop ids are this model's ids: an engine would silently never meet any other."""
        unknown = self.tokenizer.unknown_id_error(chat.stop_token_ids or [])
        if unknown is not None:
            raise PreprocessError(f"stop_token_ids: {unknown}", param="stop_token_ids")

    def _preprocessed(
        self, chat: ChatCompletionRequest, prompt: TokenizedPrompt, structured: StructuredOutput | None
    ) -> PreprocessedRequest:
        max_tokens = self._max_tokens(chat, len(prompt.token_ids))
        return PreprocessedRequest(
            model=chat.model,
            token_ids=prompt.token_ids,
            stop_conditions=StopConditions(
                max_tokens=max_tokens,
                min_tokens=chat.min_tokens,
                # Stop strings are not sent: the frontend applies them to the answer's content
                # (an engine would also stop on them inside reasoning or tool-call markup).
                stop_token_ids=list(chat.stop_token_ids or []),
                stop_token_ids_hidden=[] if chat.ignore_eos else list(self.tokenizer.eos_token_ids),
                ignore_eos=chat.ignore_eos,
            ),
            sampling_options=SamplingOptions(
                n=1,  # n > 1 is fanned out by the frontend, one engine request per choice
                temperature=chat.temperature,
                top_p=chat.top_p,
                top_k=chat.top_k,
                seed=chat.seed,
                presence_penalty=chat.presence_penalty,
                frequency_penalty=chat.frequency_penalty,
                repetition_penalty=chat.repetition_penalty,
                structured=structured,
            ),
            output_options=OutputOptions(logprobs=chat.logprobs, top_logprobs=chat.top_logprobs),
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            images=prompt.images,
            mdcsum=self.mdcsum,
            annotations=_annotations(chat, prompt),
        )

    def _max_tokens(self, chat: ChatCompletionRequest, prompt_tokens: int) -> int:
        limit = self.context_length
        requested = chat.requested_max_tokens
        if prompt_tokens >= limit:
            raise PreprocessError(
                f"This model's maximum context length is {limit} tokens. However, your messages "
                f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                param="messages",
            )
        if requested is None:
            return limit - prompt_tokens
        if prompt_tokens + requested > limit:
            raise PreprocessError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested} in "
                f"the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        return requested


def _parse(request: ChatCompletionRequest | dict[str, Any] | bytes) -> ChatCompletionRequest:
    try:
        chat = parse_chat_request(request)
    except RequestError as exc:
        raise PreprocessError(str(exc), param=exc.param) from exc
    if not chat.messages:
        raise PreprocessError("messages must contain at least one message", param="messages")
    return chat


def validate_tool_choice(chat: ChatCompletionRequest) -> None:
    """OpenAI rules: a known string, or a named function that is among the request's tools."""
    choice = chat.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_STRINGS:
            raise PreprocessError(
                f"tool_choice {choice!r} is not valid; use 'none', 'auto', 'required' or a named function",
                param="tool_choice",
            )
        if choice == "required" and not chat.tools:
            raise PreprocessError("tool_choice 'required' needs at least one tool", param="tool_choice")
        return
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise PreprocessError(
            'tool_choice must be {"type": "function", "function": {"name": ...}} when it is an object',
            param="tool_choice",
        )
    if name not in _tool_names(chat.tools):
        raise PreprocessError(
            f"tool_choice names function {name!r}, which is not in tools", param="tool_choice"
        )


def constraint_of(
    chat: ChatCompletionRequest,
    budget: TokenBudget | None = None,
    *,
    limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS,
    metaschema: bool = True,
) -> StructuredOutput | None:
    """The engine's constraint for ``response_format`` or a forced tool choice (a 400 naming the field)."""
    try:
        return structured_output(
            chat.response_format,
            chat.tools,
            chat.tool_choice,
            parallel_tool_calls=chat.parallel_tool_calls,
            budget=budget,
            limits=limits,
            metaschema=metaschema,
        )
    except StructuredOutputError as exc:
        raise PreprocessError(str(exc), param=exc.param) from exc


def _tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    names: set[str] = set()
    for tool in tools or []:
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


@dataclass(frozen=True, slots=True)
class _Range:
    low: float
    high: float | None = None  # None: no upper bound
    open_low: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        return above and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"at least {self.low:g}"
        return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"


# The sampling values an engine accepts (OpenAI's ranges; top_k -1 and 0 are "off" in vLLM and SGLang).
_RANGES: dict[str, _Range] = {
    "temperature": _Range(0, 2),
    "top_p": _Range(0, 1, open_low=True),
    "top_k": _Range(-1),
    "presence_penalty": _Range(-2, 2),
    "frequency_penalty": _Range(-2, 2),
    "repetition_penalty": _Range(0, 2, open_low=True),
    "min_tokens": _Range(0),
    "max_tokens": _Range(1),
    "max_completion_tokens": _Range(1),
}


def validate_logprobs(chat: ChatCompletionRequest) -> None:
    """``top_logprobs`` in [0, MAX_TOP_LOGPROBS], and only with ``logprobs: true`` (OpenAI's rules)."""
    top = chat.top_logprobs
    if top is None:
        return
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise PreprocessError(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs"
        )
    if not chat.logprobs:
        raise PreprocessError(
            "top_logprobs needs logprobs: set logprobs to true, or leave top_logprobs out",
            param="top_logprobs",
        )


def validate_sampling(chat: ChatCompletionRequest) -> None:
    """Reject values no engine can honour, before any work is done."""
    validate_n(chat.n)
    for name, allowed in _RANGES.items():
        value = getattr(chat, name)
        if value is not None and not allowed.holds(value):
            raise PreprocessError(f"{name} must be {allowed}, got {value}", param=name)
    validate_logprobs(chat)
    if chat.logit_bias:
        raise PreprocessError(
            "logit_bias is not supported by this frontend (it would be ignored): remove it",
            param="logit_bias",
        )
    stop_ids = chat.stop_token_ids or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise PreprocessError(
            f"Invalid 'stop_token_ids': array too long. Expected an array with maximum length "
            f"{MAX_STOP_TOKEN_IDS}, but got an array with length {len(stop_ids)} instead.",
            param="stop_token_ids",
        )
    limit = chat.requested_max_tokens
    if chat.min_tokens is not None and limit is not None and chat.min_tokens > limit:
        raise PreprocessError(f"min_tokens {chat.min_tokens} exceeds max_tokens {limit}", param="min_tokens")
    validate_stop(stop_strings(chat.stop))
    unknown = set(chat.nvext.annotations) - ANNOTATIONS if chat.nvext else set()
    if unknown:
        raise PreprocessError(
            f"unknown annotation(s) {sorted(unknown)}; known: {sorted(ANNOTATIONS)}", param="nvext"
        )


def entries_per_token(chat: ChatCompletionRequest) -> int:
    """What one answer token of ``chat`` costs the frontend, in entries: the token, and with
    logprobs its text, bytes and logprob and each alternative."""
    return 3 + (chat.top_logprobs or 0) if chat.logprobs else 1


def validate_answer_budget(chat: ChatCompletionRequest, choices: int, context_length: int) -> None:
    """``choices`` answers of ``chat`` (each at most its max_tokens, or the whole context) within
    ``MAX_ANSWER_ENTRIES`` when there are several; else a 400 naming the max_tokens parameter."""
    max_tokens = chat.requested_max_tokens
    entries = choices * (max_tokens or context_length) * entries_per_token(chat)
    if choices < 2 or entries <= MAX_ANSWER_ENTRIES:
        return
    param = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
    asked = (
        f"{param} {max_tokens:,}"
        if max_tokens is not None
        else f"no {param} (the context, {context_length:,})"
    )
    with_logprobs = f", with {chat.top_logprobs or 0} logprobs each token" if chat.logprobs else ""
    raise PreprocessError(
        f"The answer could hold {entries:,} entries ({choices} choices x {asked}{with_logprobs}), more "
        f"than this server's budget of {MAX_ANSWER_ENTRIES:,} for one request: lower {param}, n, the "
        "number of prompts or logprobs, or send several requests",
        param=param,
    )


def validate_n(n: int) -> None:
    """``n`` in [1, MAX_N]."""
    if not 1 <= n <= MAX_N:
        raise PreprocessError(f"n must be in [1, {MAX_N}], got {n}", param="n")


def validate_image_count(messages: list[dict[str, Any]]) -> None:
    """At most ``MAX_IMAGES_PER_REQUEST`` image parts in all, counted before any image is read."""
    count = sum(
        1
        for message in messages
        if isinstance(content := message.get("content"), list)
        for part in content
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    )
    if count > MAX_IMAGES_PER_REQUEST:
        raise PreprocessError(
            f"Invalid 'messages': too many images. Expected at most {MAX_IMAGES_PER_REQUEST} images "
            f"per request, but got {count} instead.",
            param="messages",
        )


def validate_stop(stops: list[str]) -> None:
    """At most ``MAX_STOP_STRINGS`` non-empty stop strings of at most ``MAX_STOP_CHARS`` characters."""
    if len(stops) > MAX_STOP_STRINGS:
        raise PreprocessError(
            f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP_STRINGS}, "
            f"but got an array with length {len(stops)} instead.",
            param="stop",
        )
    for index, stop in enumerate(stops):
        if not stop:
            raise PreprocessError("stop strings must not be empty", param="stop")
        if len(stop) > MAX_STOP_CHARS:
            raise PreprocessError(
                f"Invalid 'stop[{index}]': string too long. Expected a string with maximum length "
                f"{MAX_STOP_CHARS}, but got a string with length {len(stop)} instead.",
                param="stop",
            )


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """The request's ``stop`` as a list: None is none, a string is one."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _annotations(chat: ChatCompletionRequest, prompt: TokenizedPrompt) -> dict[str, Any]:
    wanted = set(chat.nvext.annotations) if chat.nvext else set()
    annotations: dict[str, Any] = {}
    if "formatted_prompt" in wanted:
        annotations["formatted_prompt"] = prompt.rendered.text
    if "token_ids" in wanted:
        annotations["token_ids"] = prompt.token_ids
    return annotations
