"""The mock's answers in the model's own output format, as token ids.

* Kimi-K3: the assistant turn exactly as the K3 formatter renders one in history (reasoning in
  the think channel when thinking, content in the response channel, calls in ``tools``), minus
  what the prompt already holds (the header, and the channel opener of the reference form), so
  the format has one home and a parsed answer fed back renders as it was written. Markers are
  control segments; reasoning, content, names and values are text segments, never special ids.
* A declared ``--tool-call-parser`` whose answers have a shape of their own (``WHOLE_ANSWERS``:
  ``openai`` for GPT-OSS Harmony, also chosen by model_type ``gpt_oss``; ``kimi_k2``; ``glm45``;
  ``mistral``, with ``[THINK]`` reasoning when the worker declared ``--reasoning-parser mistral``),
  on a vocabulary holding its markers as tokens: the whole answer in that format.
* Other formats: the prompt's frame (ChatML: ``<|im_start|>assistant\\n`` unless the prompt
  opened the turn, then ``<|im_end|>``; DeepSeek: the reasoning and ``</think>`` when the prompt
  opened a think block, then ``<｜end▁of▁sentence｜>``; Llama: ``<|eom_id|>`` / ``<|eom|>`` after a
  call, else ``<|eot_id|>`` / ``<|eot|>``) around a body written as the declared tool-call parser
  reads it (``BODIES``, by vLLM's name: the worker's ``--tool-call-parser``), else as the family's:
  Hermes after the content for ChatML (the chat template's own history rendering), DeepSeek V3.1's
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`` for DeepSeek, the content alone for any other.

Markers are control segments (one id where the vocabulary has the token, text where it has not).
"""

from __future__ import annotations

import json
import keyword
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from dynamo_prep.engines.mock.prompt import HEADERS, IM_END, IM_START, Family, PromptView, Tool
from dynamo_prep.formatter import KimiK3Formatter
from dynamo_prep.formatter.kimi_k3 import OPEN, SEP
from dynamo_prep.parsing.mistral import ARGS, THINK_CLOSE, THINK_OPEN, TOOL_CALLS
from dynamo_prep.prompt import Segment
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["BODIES", "WHOLE_ANSWERS", "AnswerWriter", "ToolCall", "schema_arguments"]

MOCK_STRING = "mock"
_OPEN, _SEP = Segment(OPEN, True), Segment(SEP, True)
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_THINK_CLOSE = "</think>"


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


Body = list[Segment]
"""An answer's segments: markers (control: one id where the vocabulary has the token) and text."""
BodyWriter = Callable[[str, "ToolCall | None"], Body]
_FAMILY_BODIES: Final = MappingProxyType({"chatml": "hermes", "deepseek": "deepseek_v31"})


class AnswerWriter:
    """Writes answers for one tokenizer's prompt family, calls as ``tool_call_parser`` reads them."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        family: Family,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self._k3 = KimiK3Formatter()
        default = _FAMILY_BODIES.get(family)
        self._body = BODIES.get(tool_call_parser or "") or (BODIES[default] if default else _content)
        self._whole = whole_answer_writer(tokenizer, tool_call_parser, reasoning_parser)

    def write(self, view: PromptView, *, reasoning: str, content: str, call: ToolCall | None) -> list[int]:
        if self._whole is not None:
            return self._encode(self._whole(reasoning, content, call))
        if self.family == "kimi_k3":
            return self._kimi_k3(view, reasoning, content, call)
        body = self._body(content, call)
        if self.family == "chatml":
            specials = self.tokenizer.special_tokens
            head = (
                [] if view.opened is not None else [specials[IM_START], *self.tokenizer.encode("assistant\n")]
            )
            return [*head, *self._encode(body), specials[IM_END]]
        if self.family == "deepseek":
            thought = [Segment(reasoning, False), Segment(DS_THINK_CLOSE, True)] if view.thinking else []
            return [*self._encode([*thought, *body]), *self.tokenizer.eos_token_ids[:1]]
        if self.family in HEADERS:
            ends = HEADERS[self.family].turn_ends  # (end of turn, end of a call's turn)
            called = call is not None and self._body is not _content
            body = [*body, Segment(ends[1] if called else ends[0], True)]
        return self._encode(body)

    def _kimi_k3(self, view: PromptView, reasoning: str, content: str, call: ToolCall | None) -> list[int]:
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if call is not None:
            message["tool_calls"] = [{"type": "function", "function": call._asdict()}]
        segments = self._k3.render_segments(
            [message], add_generation_prompt=False, thinking=view.thinking, thinking_effort=None
        )
        return self.tokenizer.encode_segments(segments[_written(segments, view) :])

    def _encode(self, segments: Body) -> list[int]:
        """Markers that are tokens as their ids; the text between them (and markers the vocabulary
        does not have) encoded as one text, as the model's tokenizer would."""
        runs: list[tuple[str, bool]] = []
        for text, control in segments:
            token = control and text in self.tokenizer.added_tokens
            if runs and not token and not runs[-1][1]:
                runs[-1] = (runs[-1][0] + text, False)
            elif text:
                runs.append((text, token))
        return self.tokenizer.encode_segments(runs)


# -- bodies: an answer's content and call, as a tool-call parser reads them --------------------------


def _content(content: str, call: ToolCall | None) -> Body:
    return [Segment(content, False)] if content else []


def _after_content(content: str, call_segments: Body) -> Body:
    return [*([Segment(f"{content}\n", False)] if content else []), *call_segments]


def _hermes(content: str, call: ToolCall | None) -> Body:
    """The content, then ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
    if call is None:
        return _content(content, call)
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return _after_content(
        content,
        [Segment("<tool_call>", True), Segment(f"\n{payload}\n", False), Segment("</tool_call>", True)],
    )


def _qwen3_coder(content: str, call: ToolCall | None) -> Body:
    """Qwen3-Coder's XML: each value as text (strings raw, anything else as JSON)."""
    if call is None:
        return _content(content, call)
    body = f"\n<function={call.name}>\n"
    for key, value in call.arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        body += f"<parameter={key}>\n{text}\n</parameter>\n"
    return _after_content(
        content,
        [Segment("<tool_call>", True), Segment(body + "</function>\n", False), Segment("</tool_call>", True)],
    )


def _deepseek(content: str, call: ToolCall | None, *, v3: bool) -> Body:
    """The content, then one call in a calls section (V3: fenced JSON after ``function``)."""
    segments = _content(content, call)
    if call is None:
        return segments
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    head, body = ("function", f"{call.name}\n```json\n{arguments}\n```") if v3 else (call.name, arguments)
    return [
        *segments,
        Segment(DS_CALLS_BEGIN, True),
        Segment(DS_CALL_BEGIN, True),
        Segment(head, False),
        Segment(DS_SEP, True),
        Segment(body, False),
        Segment(DS_CALL_END, True),
        Segment(DS_CALLS_END, True),
    ]


def _llama3_json(content: str, call: ToolCall | None) -> Body:
    """A call alone (as Llama 3.1 answers): ``{"name": ..., "parameters": {...}}``; else the content."""
    if call is None:
        return _content(content, call)
    return [Segment(json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False), False)]


def _pythonic(content: str, call: ToolCall | None) -> Body:
    """A call alone: ``[name(key=literal, ...)]`` (arguments whose key is no Python name cannot be
    written so: left out); else the content."""
    if call is None:
        return _content(content, call)
    arguments = ", ".join(
        f"{key}={_python_literal(value)}"
        for key, value in call.arguments.items()
        if key.isidentifier() and not keyword.iskeyword(key)
    )
    return [Segment(f"[{call.name}({arguments})]", False)]


def _llama4_pythonic(content: str, call: ToolCall | None) -> Body:
    """``_pythonic``, a call wrapped in ``<|python_start|>`` ... ``<|python_end|>`` as Llama 4 may."""
    body = _pythonic(content, call)
    return (
        [Segment("<|python_start|>", True), *body, Segment("<|python_end|>", True)]
        if call is not None
        else body
    )


def _python_literal(value: Any) -> str:
    """A JSON value as Python writes it: ``None``, ``True``, repr strings, lists, dicts."""
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


BODIES: Final[Mapping[str, BodyWriter]] = MappingProxyType(
    {
        "hermes": _hermes,
        "qwen3_json": _hermes,
        "llama3_json": _llama3_json,
        "llama4_json": _llama3_json,
        "pythonic": _pythonic,
        "llama4_pythonic": _llama4_pythonic,
        "qwen3_coder": _qwen3_coder,
        "deepseek_v3": lambda content, call: _deepseek(content, call, v3=True),
        "deepseek_v31": lambda content, call: _deepseek(content, call, v3=False),
    }
)
"""How the mock writes an answer's content and call inside its family's turn, by the tool-call
parser that reads it (vLLM's names)."""


# -- whole answers: formats whose answer has a shape of its own (reasoning, content, a call) --------

WholeWriter = Callable[[str, str, "ToolCall | None"], list[Segment]]


def _marker(text: str) -> Segment:
    return Segment(text, True)


def _text(text: str) -> Segment:
    return Segment(text, False)


def _arguments_json(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)


def _harmony(reasoning: str, content: str, call: ToolCall | None) -> list[Segment]:
    """GPT-OSS: the prompt opened the assistant's message; analysis, a commentary preamble before a
    call, then the call (``<|call|>``) or the final answer (``<|return|>``)."""
    start = [_marker("<|start|>"), _text("assistant")]
    segments: list[Segment] = []
    for channel, text in (("analysis", reasoning), ("commentary", content if call is not None else "")):
        if text:
            segments += [_marker("<|channel|>"), _text(channel), _marker("<|message|>"), _text(text)]
            segments += [_marker("<|end|>"), *start]
    if call is None:
        return [
            *segments,
            _marker("<|channel|>"),
            _text("final"),
            _marker("<|message|>"),
            _text(content),
            _marker("<|return|>"),
        ]
    header = [
        _marker("<|channel|>"),
        _text(f"commentary to=functions.{call.name} "),
        _marker("<|constrain|>"),
    ]
    return [
        *segments,
        *header,
        _text("json"),
        _marker("<|message|>"),
        _text(_arguments_json(call)),
        _marker("<|call|>"),
    ]


def _kimi_k2(reasoning: str, content: str, call: ToolCall | None) -> list[Segment]:
    """Kimi-K2: the content, then the call's section (its id ``functions.NAME:0``), then ``<|im_end|>``."""
    segments = [_text(content)] if content else []
    if call is not None:
        segments += [_marker("<|tool_calls_section_begin|>"), _marker("<|tool_call_begin|>")]
        segments += [_text(f"functions.{call.name}:0"), _marker("<|tool_call_argument_begin|>")]
        segments += [
            _text(_arguments_json(call)),
            _marker("<|tool_call_end|>"),
            _marker("<|tool_calls_section_end|>"),
        ]
    return [*segments, _marker("<|im_end|>")]


def _glm45(reasoning: str, content: str, call: ToolCall | None) -> list[Segment]:
    """GLM-4.5: the model's think block, the content, the call's tag block (strings raw, other values
    as JSON, as its template writes them), then the turn's end (``<|observation|>`` after a call)."""
    segments = [_text("\n"), _marker("<think>"), _text(reasoning), _marker("</think>")]
    if content:
        segments.append(_text("\n" + content))
    if call is None:
        return [*segments, _marker("<|user|>")]
    segments += [_text("\n"), _marker("<tool_call>"), _text(call.name + "\n")]
    for key, value in call.arguments.items():
        written = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        segments += [_marker("<arg_key>"), _text(key), _marker("</arg_key>"), _text("\n")]
        segments += [_marker("<arg_value>"), _text(written), _marker("</arg_value>"), _text("\n")]
    return [*segments, _marker("</tool_call>"), _marker("<|observation|>")]


def _mistral(reasoning: str, content: str, call: ToolCall | None, *, v11: bool) -> list[Segment]:
    """Mistral: ``[THINK]...[/THINK]`` when there is reasoning to write, the content, then the call:
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+ vocabularies, which have ``[ARGS]``), else
    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``."""
    segments = [_marker(THINK_OPEN), _text(reasoning), _marker(THINK_CLOSE)] if reasoning else []
    if content:
        segments.append(_text(content))
    if call is not None and v11:
        segments += [_marker(TOOL_CALLS), _text(call.name), _marker(ARGS), _text(_arguments_json(call))]
    elif call is not None:
        segments += [_marker(TOOL_CALLS), _text(json.dumps([call._asdict()], ensure_ascii=False))]
    return segments


WHOLE_ANSWERS: Final[dict[str, WholeWriter]] = {
    "openai": _harmony,
    "kimi_k2": _kimi_k2,
    "glm45": _glm45,
    "mistral": lambda reasoning, content, call: _mistral(reasoning, content, call, v11=False),
}
"""The mock's answer formats by vLLM's tool-call parser name."""
GPT_OSS_MODEL_TYPE: Final = "gpt_oss"


def whole_answer_writer(
    tokenizer: Tokenizer, tool_call_parser: str | None, reasoning_parser: str | None = None
) -> WholeWriter | None:
    """The writer of the declared parser (GPT-OSS's Harmony by model_type when none is declared), when
    the vocabulary holds every marker it writes as a token; else None. Mistral writes the v11 call
    form where the vocabulary has ``[ARGS]``, its end of sentence last, and reasoning only when the
    worker declared Mistral's reasoning parser and the vocabulary has ``[THINK]``."""
    if tool_call_parser is None and tokenizer.model_type == GPT_OSS_MODEL_TYPE:
        tool_call_parser = "openai"
    writer = WHOLE_ANSWERS.get(tool_call_parser or "")
    reasoning = "r"
    if tool_call_parser == "mistral":
        think = reasoning_parser == "mistral" and all(
            map(tokenizer.is_special_token, (THINK_OPEN, THINK_CLOSE))
        )
        writer = _mistral_writer(tokenizer, think=think)
        reasoning = "r" if think else ""
    if writer is None:
        return None
    probe = writer(reasoning, "c", ToolCall("f", {"k": 1}))
    return writer if all(tokenizer.is_special_token(s.text) for s in probe if s.allow_special) else None


def _mistral_writer(tokenizer: Tokenizer, *, think: bool) -> WholeWriter:
    v11 = tokenizer.is_special_token(ARGS)
    eos = (
        [_marker(name)]
        if tokenizer.eos_token_ids and (name := tokenizer.id_to_token(tokenizer.eos_token_ids[0]))
        else []
    )

    def write(reasoning: str, content: str, call: ToolCall | None) -> list[Segment]:
        return [*_mistral(reasoning if think else "", content, call, v11=v11), *eos]

    return write


def schema_arguments(tool: Tool) -> dict[str, Any]:
    """Arguments for ``tool`` from its JSON schema: one plausible value per property, in order."""
    properties = tool.parameters.get("properties")
    if not isinstance(properties, dict):
        return {}
    return {str(key): _example(schema) for key, schema in properties.items()}


def _example(schema: Any) -> Any:
    """enum: its first value; string: a short string; number/integer: 1; boolean: true; array: [];
    object: {}; null: null; anything else: a short string."""
    if not isinstance(schema, dict):
        return MOCK_STRING
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):  # e.g. ["string", "null"]: the first non-null type
        kind = next((item for item in kind if item != "null"), "null")
    values: dict[Any, Any] = {
        "number": 1,
        "integer": 1,
        "boolean": True,
        "array": [],
        "object": {},
        "null": None,
    }
    return values.get(kind, MOCK_STRING) if isinstance(kind, str) else MOCK_STRING


def _written(segments: Sequence[Segment], view: PromptView) -> int:
    """How many leading segments of a rendered assistant turn the prompt already ends with."""
    if view.opened is None:
        return 0
    header_end = segments.index(_SEP) + 1
    if view.opened == "message":
        return header_end
    for index in range(header_end, len(segments) - 2):
        if segments[index : index + 3] == [_OPEN, Segment(view.opened, False), _SEP]:
            return index + 3
    return header_end
