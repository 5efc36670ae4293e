"""The mock's answers in the model's own output format, as token ids.

* Kimi-K3: the assistant turn exactly as the K3 formatter renders one in history (reasoning in
  the think channel when thinking, content in the response channel, calls in ``tools``), minus
  what the prompt already holds (the header, and the channel opener of the reference form), so
  the format has one home and a parsed answer fed back renders as it was written. Markers are
  control segments; reasoning, content, names and values are text segments, never special ids.
* Other formats: the prompt's frame (ChatML: ``<|im_start|>assistant\\n`` unless the prompt
  opened the turn, then ``<|im_end|>``; Llama: ``<|eom_id|>`` / ``<|eom|>`` after a call, else
  ``<|eot_id|>`` / ``<|eot|>``) around a body written as the declared tool-call parser reads it
  (``BODIES``, by vLLM's name: the worker's ``--tool-call-parser``), else as the family's:
  Hermes ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` after the content for
  ChatML (the chat template's own history rendering), the content alone for any other.
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
from dynamo_prep.prompt import Segment
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["BODIES", "AnswerWriter", "ToolCall", "schema_arguments"]

MOCK_STRING = "mock"
_OPEN, _SEP = Segment(OPEN, True), Segment(SEP, True)


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


Body = list[tuple[str, bool]]
"""An answer's segments: (text, whether it is a marker: one id where the vocabulary has it)."""


class AnswerWriter:
    """Writes answers for one tokenizer's prompt family, calls as ``tool_call_parser`` reads them."""

    def __init__(self, tokenizer: Tokenizer, family: Family, tool_call_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self._k3 = KimiK3Formatter()
        default = "hermes" if family == "chatml" else None
        self._body = BODIES.get(tool_call_parser or "") or (BODIES[default] if default else _content)

    def write(self, view: PromptView, *, reasoning: str, content: str, call: ToolCall | None) -> list[int]:
        if self.family == "kimi_k3":
            return self._kimi_k3(view, reasoning, content, call)
        body = self._body(content, call)
        if self.family == "chatml":
            return self._chatml(view, body)
        if self.family in HEADERS:
            ends = HEADERS[self.family].turn_ends  # (end of turn, end of a call's turn)
            called = call is not None and self._body is not _content
            body = [*body, (ends[1] if called else ends[0], True)]
        return self.tokenizer.encode_segments(body)

    def _kimi_k3(self, view: PromptView, reasoning: str, content: str, call: ToolCall | None) -> list[int]:
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if call is not None:
            message["tool_calls"] = [{"type": "function", "function": call._asdict()}]
        segments = self._k3.render_segments(
            [message], add_generation_prompt=False, thinking=view.thinking, thinking_effort=None
        )
        return self.tokenizer.encode_segments(segments[_written(segments, view) :])

    def _chatml(self, view: PromptView, body: Body) -> list[int]:
        specials = self.tokenizer.special_tokens
        head = [] if view.opened is not None else [specials[IM_START], *self.tokenizer.encode("assistant\n")]
        return [*head, *self.tokenizer.encode_segments(body), specials[IM_END]]


def _content(content: str, call: ToolCall | None) -> Body:
    return [(content, False)] if content else []


def _hermes(content: str, call: ToolCall | None) -> Body:
    """The content, then ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` (one text:
    as the Qwen-VL demo's template renders a call in history)."""
    text = content
    if call is not None:
        payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        written = f"<tool_call>\n{payload}\n</tool_call>"
        text = f"{content}\n{written}" if content else written
    return [(text, False)] if text else []


def _llama3_json(content: str, call: ToolCall | None) -> Body:
    """A call alone (as Llama 3.1 answers): ``{"name": ..., "parameters": {...}}``; else the content."""
    if call is None:
        return _content(content, call)
    return [(json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False), False)]


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
    return [(f"[{call.name}({arguments})]", False)]


def _llama4_pythonic(content: str, call: ToolCall | None) -> Body:
    """``_pythonic``, a call wrapped in ``<|python_start|>`` ... ``<|python_end|>`` as Llama 4 may."""
    body = _pythonic(content, call)
    return [("<|python_start|>", True), *body, ("<|python_end|>", True)] if call is not None else body


def _python_literal(value: Any) -> str:
    """A JSON value as Python writes it: ``None``, ``True``, repr strings, lists, dicts."""
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


BODIES: Final[Mapping[str, Callable[[str, ToolCall | None], Body]]] = MappingProxyType(
    {
        "hermes": _hermes,
        "qwen3_json": _hermes,
        "llama3_json": _llama3_json,
        "llama4_json": _llama3_json,
        "pythonic": _pythonic,
        "llama4_pythonic": _llama4_pythonic,
    }
)
"""How the mock writes an answer's content and call for each tool-call parser (vLLM's names)."""


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
