"""vLLM's own parsers as the oracle of ours: the same model output, as token ids, through both.

A ``Family`` names vLLM's parsers (``--tool-call-parser`` / ``--reasoning-parser``), a model
directory whose vocabulary both sides load (ours: ``Tokenizer``; vLLM: its own tokenizer over the
same ``tokenizer.json``), and a Hypothesis strategy of model outputs. ``answers`` runs one output
four ways: ours whole and streamed id by id (equal by construction, checked), and vLLM the way its
chat server does: ``ParserManager.get_parser`` composes the reasoning and tool parser classes, the
request is adjusted by them (``skip_special_tokens``), the ids are detokenized by vLLM's own
incremental detokenizer, then ``Parser.parse`` (non-streamed) or ``Parser.parse_delta`` per id.
Answers compare content and reasoning up to surrounding whitespace and calls by name and
arguments as JSON values.

GPT-OSS (``harmony``): vLLM reads Harmony with openai-harmony's ``StreamableParser`` on the real
o200k_harmony ids (its ``HarmonyParser``, chosen for model_type ``gpt_oss``), whatever the
tokenizer; so the same output goes to vLLM as openai-harmony encodes its segments (text as
ordinary text, markers as their ids), and to ours on the gpt_oss directory's vocabulary.

Where vLLM has a known bug, the family lists a ``Divergence``: outputs of that shape are not
compared for that vLLM mode, and the divergence's own example is an ``xfail(strict=True)`` test
that shows vLLM's answer differs (so a vLLM fix shows up as an XPASS). docs/answers.md says which
behaviour we follow.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from hypothesis import strategies as st

from dynamo_prep.parsing import (
    ContentDelta,
    ParseOptions,
    ReasoningDelta,
    fold_deltas,
    parse_answer,
    parser_for,
    prompt_ends_in_think,
    thinking_requested,
    tool_properties,
)
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.tokenizer import Tokenizer

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

Segment = tuple[str, bool]
"""Text, and whether it is a marker (one id where the vocabulary has it as a token)."""
PromptEnd = Literal["open", "closed", "plain"]
"""How the prompt ends: a reasoning block left open (thinking), closed empty (thinking off), none."""
Mode = Literal["whole", "streamed"]
MODES: tuple[Mode, ...] = ("whole", "streamed")
TOOL_NAMES = ("get_weather", "search_web", "lookup", "f")


@dataclass(frozen=True)
class Output:
    """One model output: its segments, how the prompt before it ended, what it holds (``shapes``),
    and where its calls stand in its text (character spans, markers spelled out)."""

    segments: tuple[Segment, ...]
    prompt: PromptEnd = "plain"
    shapes: frozenset[str] = frozenset()
    call_spans: tuple[tuple[int, int], ...] = ()
    breaks: tuple[int, ...] = ()
    """Segment indices where encoding starts afresh: the ids of text a model wrote piece by piece
    (``<tool`` then ``_call>``), which one encode would merge into a marker token."""

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        bounds = (0, *self.breaks, len(self.segments))
        return [
            i
            for a, b in itertools.pairwise(bounds)
            for i in tokenizer.encode_segments(list(self.segments[a:b]))
        ]


class Writer:
    """Builds an ``Output`` piece by piece, keeping the character span of each call."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.spans: list[tuple[int, int]] = []
        self.shapes: set[str] = set()
        self.breaks: list[int] = []
        self._size = 0
        self._call_start: int | None = None

    def text(self, text: str) -> Writer:
        if text:
            self.segments.append((text, False))
            self._size += len(text)
        return self

    def marker(self, marker: str) -> Writer:
        self.segments.append((marker, True))
        self._size += len(marker)
        return self

    def typed(self, marker: str) -> Writer:
        """``marker`` written as text, in two pieces that no encode joins into the marker's token."""
        half = len(marker) // 2
        self.text(marker[:half])
        self.breaks.append(len(self.segments))
        return self.text(marker[half:])

    def call(self, *pieces: Segment) -> Writer:
        start = self._size
        for text, is_marker in pieces:
            self.marker(text) if is_marker else self.text(text)
        self.spans.append((start, self._size))
        return self

    def output(self, prompt: PromptEnd = "plain") -> Output:
        return Output(
            tuple(self.segments), prompt, frozenset(self.shapes), tuple(self.spans), tuple(self.breaks)
        )


@dataclass(frozen=True)
class Answer:
    reasoning: str
    content: str
    calls: tuple[tuple[str, Any], ...]

    def normalized(self) -> Answer:
        """Content and reasoning up to surrounding whitespace."""
        return Answer(self.reasoning.strip(), self.content.strip(), self.calls)


@dataclass(frozen=True)
class Divergence:
    """A known vLLM bug: outputs with ``shape`` differ from ours in ``modes``; ``example`` shows it."""

    shape: str
    modes: tuple[Mode, ...]
    reason: str
    example: Output


@dataclass(frozen=True)
class Family:
    """vLLM's parser names for one model family, its directory, and its generated outputs."""

    id: str
    model: str
    tool_parser: str | None
    reasoning_parser: str | None
    outputs: st.SearchStrategy[Output]
    prompt: Callable[[PromptEnd], Sequence[Segment]]
    divergences: tuple[Divergence, ...] = ()
    held_tags: tuple[str, ...] = ()
    """Tags vLLM's streaming parser holds back while the text could still become one: an answer
    ending in a proper prefix of one has the shape ``ends_in_tag_prefix``."""
    tools: tuple[str, ...] = field(default=TOOL_NAMES)
    text_markers: tuple[str, ...] = ()
    """Markers that are no token in the vocabulary (matched in text by both sides)."""
    properties: dict[str, Any] = field(default_factory=dict)
    """The ``properties`` of every tool's parameters schema (formats that type values by it)."""
    parameters: dict[str, Any] | None = None
    """Every tool's whole JSON schema, when given (else an object of ``properties``)."""
    harmony: bool = False
    """vLLM reads it with its ``HarmonyParser`` on openai-harmony's ids (GPT-OSS)."""

    def declared(self) -> list[dict[str, Any]]:
        """The request's ``tools``, as both sides get them."""
        schema = self.parameters or {
            "type": "object",
            "properties": self.properties,
            "additionalProperties": True,
        }
        return [{"type": "function", "function": {"name": name, "parameters": schema}} for name in self.tools]

    def cut_in_marker(self, text: str) -> bool:
        """``text`` (an answer cut by max_tokens) ends in a proper prefix of a text marker."""
        return any(
            text.endswith(marker[:size]) for marker in self.text_markers for size in range(1, len(marker))
        )

    def known(self, output: Output, mode: Mode, text: str | None = None) -> Divergence | None:
        """The divergence that covers ``output`` (``text``: as cut) in ``mode``, if any."""
        shapes = set(output.shapes)
        text = output.text if text is None else text
        if any(text.endswith(tag[:size]) for tag in self.held_tags for size in range(1, len(tag))):
            shapes.add("ends_in_tag_prefix")
        return next((d for d in self.divergences if d.shape in shapes and mode in d.modes), None)


# -- ours ------------------------------------------------------------------------------------------


@cache
def our_tokenizer(directory: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(directory)


def our_answers(
    family: Family, directory: Path, output: Output, finish: str = "stop", cut: int | None = None
) -> Answer:
    """Ours whole and streamed id by id, checked equal; the answer (of the first ``cut`` ids)."""
    tokenizer = our_tokenizer(directory)
    prompt_text = "".join(text for text, _ in family.prompt(output.prompt))
    thinking = prompt_ends_in_think(prompt_text)
    assert thinking == (output.prompt == "open")

    def parser():  # type: ignore[no-untyped-def]
        counter = iter(range(1000))
        options = ParseOptions(
            thinking=thinking,
            call_ids=lambda: f"call_{next(counter)}",
            thinking_requested=thinking_requested(template_kwargs(output)),
            tool_properties=tool_properties(family.declared()),
        )
        return parser_for(vocab_of(tokenizer), family.reasoning_parser, family.tool_parser, options)

    ids = output.ids(tokenizer)[:cut]
    whole = parse_answer(parser(), ids, finish)
    streaming = parser()
    deltas = [delta for token_id in ids for delta in streaming.feed([token_id])]
    deltas += streaming.finish(finish)
    assert fold_deltas(deltas) == whole, "ours: streamed != whole"
    assert all(d.text for d in deltas if isinstance(d, ReasoningDelta | ContentDelta))
    calls = tuple((call.name, json.loads(call.arguments)) for call in whole.tool_calls)
    return Answer(whole.reasoning, whole.content, calls)


# -- vLLM ------------------------------------------------------------------------------------------


@cache
def vllm_tokenizer(directory: Path) -> Any:
    from vllm.tokenizers import get_tokenizer  # noqa: PLC0415

    return get_tokenizer(str(directory))


def template_kwargs(output: Output) -> dict[str, Any]:
    """The request's ``chat_template_kwargs``: thinking on unless the prompt closed the block (Qwen3
    reads ``enable_thinking``, DeepSeek ``thinking``)."""
    return {"enable_thinking": output.prompt != "closed", "thinking": output.prompt != "closed"}


class VllmRun:
    """One output through vLLM's parsers, as ``OpenAIServingChat`` runs them."""

    def __init__(self, family: Family, directory: Path, output: Output) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: PLC0415
        from vllm.parser.parser_manager import ParserManager  # noqa: PLC0415

        self.tokenizer = vllm_tokenizer(directory)
        self.kwargs = template_kwargs(output)
        request = ChatCompletionRequest(
            model="oracle",
            messages=[{"role": "user", "content": "hi"}],
            tools=family.declared(),
            chat_template_kwargs=self.kwargs,
        )
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=family.tool_parser,
            reasoning_parser_name=family.reasoning_parser,
            enable_auto_tools=True,
            model_name="oracle",
            tokenizer=self.tokenizer,
        )
        self.request = self._new_parser(request).adjust_request(request)
        ours = our_tokenizer(directory)
        self.prompt_ids = ours.encode_segments(list(family.prompt(output.prompt)))

    def _new_parser(self, request: Any) -> Any:
        return self.parser_cls(
            self.tokenizer, request.tools, chat_template_kwargs=self.kwargs, model_config=None
        )

    def _detokenizer(self) -> Any:
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer  # noqa: PLC0415

        params = SamplingParams(
            skip_special_tokens=self.request.skip_special_tokens,
            spaces_between_special_tokens=self.request.spaces_between_special_tokens,
        )
        request = SimpleNamespace(
            request_id="oracle", prompt_token_ids=self.prompt_ids, sampling_params=params
        )
        return IncrementalDetokenizer.from_new_request(self.tokenizer, request)  # type: ignore[arg-type]

    def whole(self, ids: Sequence[int]) -> Answer:
        detokenizer = self._detokenizer()
        detokenizer.update(list(ids), False)
        text = detokenizer.get_next_output_text(finished=True, delta=False)
        parser = self._new_parser(self.request)
        parser.set_prompt_token_ids(self.prompt_ids)
        reasoning, content, calls = parser.parse(
            text, self.request, enable_auto_tools=True, model_output_token_ids=list(ids)
        )
        return Answer(
            reasoning or "", content or "", tuple((c.name, _arguments(c.arguments)) for c in calls or ())
        )

    def streamed(self, ids: Sequence[int]) -> Answer:
        detokenizer = self._detokenizer()
        parser = self._new_parser(self.request)
        messages = []
        for at, token_id in enumerate(ids):
            last = at == len(ids) - 1
            detokenizer.update([token_id], False)
            delta = detokenizer.get_next_output_text(finished=last, delta=True)
            messages.append(
                parser.parse_delta(
                    delta_text=delta,
                    delta_token_ids=[token_id],
                    request=self.request,
                    prompt_token_ids=self.prompt_ids,
                    finished=last,
                )
            )
        return _fold(messages)


def _fold(messages: Sequence[Any]) -> Answer:
    """What a streaming client assembles from vLLM's delta messages."""
    reasoning, content = [], []
    calls: dict[int, list[str]] = {}
    for message in messages:
        if message is None:
            continue
        reasoning.append(message.reasoning or "")
        content.append(message.content or "")
        for call in message.tool_calls or ():
            name, arguments = calls.setdefault(call.index, ["", ""])
            function = call.function
            if function is not None:
                calls[call.index] = [name or (function.name or ""), arguments + (function.arguments or "")]
    folded = tuple((name, _arguments(arguments)) for name, arguments in (calls[i] for i in sorted(calls)))
    return Answer("".join(reasoning), "".join(content), folded)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ("not JSON", text)


@cache
def harmony_encoding() -> Any:
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding  # noqa: PLC0415

    return get_encoding()


class HarmonyRun(VllmRun):
    """One output through vLLM's ``HarmonyParser``, as ``OpenAIServingChat`` runs it for a gpt_oss
    model: ids only (the text deltas are not read), on openai-harmony's encoding."""

    def __init__(self, family: Family, directory: Path, output: Output) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: PLC0415
        from vllm.parser.parser_manager import ParserManager  # noqa: PLC0415

        encoding = harmony_encoding()
        self.tokenizer = SimpleNamespace(decode=lambda ids, **_: encoding.decode(list(ids)))
        self.kwargs = {}
        self.request = ChatCompletionRequest(
            model="oracle", messages=[{"role": "user", "content": "hi"}], tools=family.declared()
        )
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=family.tool_parser,
            reasoning_parser_name=family.reasoning_parser,
            enable_auto_tools=True,
            model_name="oracle",
            is_harmony=True,
            tokenizer=self.tokenizer,
        )
        self.request = self._new_parser(self.request).adjust_request(self.request)
        self.prompt_ids = harmony_ids(family.prompt(output.prompt))

    def whole(self, ids: Sequence[int]) -> Answer:
        parser = self._new_parser(self.request)
        reasoning, content, calls = parser.parse(
            "", self.request, enable_auto_tools=True, model_output_token_ids=list(ids)
        )
        return Answer(
            reasoning or "", content or "", tuple((c.name, _arguments(c.arguments)) for c in calls or ())
        )

    def streamed(self, ids: Sequence[int]) -> Answer:
        parser = self._new_parser(self.request)
        messages = [
            parser.parse_delta(
                delta_text="",
                delta_token_ids=[token_id],
                request=self.request,
                prompt_token_ids=self.prompt_ids,
                finished=at == len(ids) - 1,
            )
            for at, token_id in enumerate(ids)
        ]
        return _fold(messages)


def harmony_ids(segments: Sequence[Segment]) -> list[int]:
    """Segments as openai-harmony encodes them: text as ordinary text, markers as their ids."""
    encoding = harmony_encoding()
    return [
        i
        for text, marker in segments
        for i in (
            encoding.encode(text, allowed_special="all")
            if marker
            else encoding.encode(text, disallowed_special=())
        )
    ]


def _cut_segments(output: Output, text: str) -> list[Segment]:
    """The segments of ``output`` up to the longest prefix of its text that ``text`` (a cut's decoded
    ids) shares with it; a marker is kept only whole."""
    size = next((at for at, (a, b) in enumerate(zip(output.text, text, strict=False)) if a != b), len(text))
    kept: list[Segment] = []
    for piece, marker in output.segments:
        if size <= 0:
            break
        if len(piece) <= size or not marker:
            kept.append((piece[:size], marker))
        size -= len(piece)
    return kept


def vllm_answer(
    family: Family, directory: Path, output: Output, mode: Mode, cut: int | None = None
) -> Answer:
    tokenizer = our_tokenizer(directory)
    ids = output.ids(tokenizer)
    if family.harmony:
        run: VllmRun = HarmonyRun(family, directory, output)
        segments = output.segments if cut is None else _cut_segments(output, tokenizer.decode(ids[:cut]))
        ids = harmony_ids(segments)
    else:
        run = VllmRun(family, directory, output)
        ids = ids if cut is None else ids[:cut]
    return run.whole(ids) if mode == "whole" else run.streamed(ids)


def differences(ours: Answer, theirs: Answer) -> list[str]:
    a, b = ours.normalized(), theirs.normalized()
    return [
        f"{what}: ours {getattr(a, what)!r} != vLLM {getattr(b, what)!r}"
        for what in ("reasoning", "content", "calls")
        if getattr(a, what) != getattr(b, what)
    ]


# -- strategies every family draws from -----------------------------------------------------------


def words(
    alphabet: str = "abcxyz ,.!?:\n\t'\"\\<>[]()#*-你好é😀", *, min_size: int = 1
) -> st.SearchStrategy[str]:
    """Model text: ASCII and non-ASCII, quotes, backslashes and brackets (no marker can be spelled)."""
    return st.text(alphabet=alphabet, min_size=min_size, max_size=30)


_KEY = st.text(alphabet='abcdxyz_é你"\\ 😀', min_size=1, max_size=8)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**9), 10**9)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(alphabet='abc xyz"\\/\n\t{}[]<>:,;你好é😀\u2028', max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_KEY, children, max_size=3),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(_KEY, JSON_VALUES, max_size=4)


@st.composite
def json_text(draw: st.DrawFn, value: Any) -> str:
    """``value`` as a model may spell it: compact or spaced, escapes or raw UTF-8."""
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (",", ": ")]))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), separators=separators)
