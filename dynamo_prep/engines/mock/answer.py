"""The mock's answers in the model's own output format, as token ids.

* Kimi-K3: the assistant turn exactly as the K3 formatter renders one in history (reasoning in
  the think channel when thinking, content in the response channel, calls in ``tools``), minus
  what the prompt already holds (the header, and the channel opener of the reference form), so
  the format has one home and a parsed answer fed back renders as it was written. Markers are
  control segments; reasoning, content, names and values are text segments, never special ids.
* ChatML (Qwen-VL demo): the content, then ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  for a call (the chat template's own history rendering), then ``<|im_end|>``.
* Any other format: the content as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from dynamo_prep.engines.mock.prompt import IM_END, IM_START, Family, PromptView, Tool
from dynamo_prep.formatter import KimiK3Formatter
from dynamo_prep.formatter.kimi_k3 import OPEN, SEP
from dynamo_prep.parsing.mistral import ARGS, THINK_CLOSE, THINK_OPEN, TOOL_CALLS
from dynamo_prep.prompt import Segment
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["TOOL_CALL_WRITERS", "AnswerWriter", "ToolCall", "schema_arguments"]

MOCK_STRING = "mock"
_OPEN, _SEP = Segment(OPEN, True), Segment(SEP, True)


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


class AnswerWriter:
    """Writes answers for one tokenizer's prompt family, or in the format of the worker's declared
    tool-call parser when ``TOOL_CALL_WRITERS`` has one for it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        family: Family,
        *,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._k3 = KimiK3Formatter()

    def write(self, view: PromptView, *, reasoning: str, content: str, call: ToolCall | None) -> list[int]:
        declared = TOOL_CALL_WRITERS.get(self.tool_call_parser or "")
        if declared is not None:
            return declared(self, view, reasoning, content, call)
        if self.family == "kimi_k3":
            return self._kimi_k3(view, reasoning, content, call)
        if self.family == "chatml":
            return self._chatml(view, content, call)
        return self.tokenizer.encode(content)

    def _kimi_k3(self, view: PromptView, reasoning: str, content: str, call: ToolCall | None) -> list[int]:
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if call is not None:
            message["tool_calls"] = [{"type": "function", "function": call._asdict()}]
        segments = self._k3.render_segments(
            [message], add_generation_prompt=False, thinking=view.thinking, thinking_effort=None
        )
        return self.tokenizer.encode_segments(segments[_written(segments, view) :])

    def _chatml(self, view: PromptView, content: str, call: ToolCall | None) -> list[int]:
        text = content
        if call is not None:
            payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            written = f"<tool_call>\n{payload}\n</tool_call>"
            text = f"{content}\n{written}" if content else written
        specials = self.tokenizer.special_tokens
        head = [] if view.opened is not None else [specials[IM_START], *self.tokenizer.encode("assistant\n")]
        return [*head, *self.tokenizer.encode(text), specials[IM_END]]


def _mistral(
    writer: AnswerWriter, view: PromptView, reasoning: str, content: str, call: ToolCall | None
) -> list[int]:
    """Mistral's answer: ``[THINK]...[/THINK]`` when the worker declared Mistral reasoning and the
    vocabulary has it, the content, the call in the vocabulary's form, the end of sentence."""
    tokenizer = writer.tokenizer
    has = tokenizer.is_special_token
    segments: list[tuple[str, bool]] = []
    if writer.reasoning_parser == "mistral" and has(THINK_OPEN) and has(THINK_CLOSE):
        segments += [(THINK_OPEN, True), (reasoning, False), (THINK_CLOSE, True)]
    if content:
        segments.append((content, False))
    if call is not None and has(TOOL_CALLS):
        if has(ARGS):  # v11+: [TOOL_CALLS]name[ARGS]{...}
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            segments += [(TOOL_CALLS, True), (call.name, False), (ARGS, True), (arguments, False)]
        else:  # before v11: [TOOL_CALLS][{"name": ..., "arguments": {...}}]
            payload = json.dumps([call._asdict()], ensure_ascii=False)
            segments += [(TOOL_CALLS, True), (payload, False)]
    return [*tokenizer.encode_segments(segments), *tokenizer.eos_token_ids[:1]]


WriteAnswer = Callable[[AnswerWriter, PromptView, str, str, ToolCall | None], list[int]]
TOOL_CALL_WRITERS: Mapping[str, WriteAnswer] = {"mistral": _mistral}
"""The mock's answer writer for a declared ``--tool-call-parser`` (vLLM's names)."""


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
