"""Kimi-K3 XTML prompt formatter: the checkpoint encoder's segments, with errors a user can act on.

``render_segments`` reproduces the reference encoder ``encoding_k3.build_chat_segments`` (HF-main
revision, "A" in the contract ``docs/spec/kimi-k3-xtml.md``) segment for segment: 4-segment
attributes, no coalescing, empty segments dropped, Python ``json`` semantics. Where the reference
raises KeyError/TypeError/ValueError/AssertionError, this raises ``PromptRenderError`` naming the
message and field, so a bad request is a 400 and never a 500.

Deliberate deviations from the reference:

* Text is never split on a typed ``<|kimi_image_placeholder|>``. The reference, when given image
  prompts, turns that literal in user text into an image slot; here typed text always stays one
  text segment and only real image parts render the image token (SGLang neutralizes typed
  placeholders for the same reason). Each image part renders ``image_token`` once, so the
  reference's image-prompt count errors cannot occur.
* Kimi partial mode (a final assistant message with ``"partial": true``) renders an open turn in
  place of the generation prompt, as Dynamo's renderer does; the reference has no such mode.
* ``render`` (the serving layer) rejects non-dict messages, missing roles and unknown roles
  instead of silently skipping them; ``render_segments`` keeps the reference's skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple

from dynamo_prep.formatter.parts import IMAGE_PART_TYPES
from dynamo_prep.formatter.template_args import template_args_of
from dynamo_prep.prompt import Piece, PromptRenderError, RenderedPrompt, Run, Segment, flatten
from dynamo_prep.protocol.openai import ChatCompletionRequest

OPEN: Final = "<|open|>"
CLOSE: Final = "<|close|>"
SEP: Final = "<|sep|>"
END_OF_MSG: Final = "<|end_of_msg|>"
MARKERS: Final = frozenset({OPEN, CLOSE, SEP, END_OF_MSG})
MODEL_TYPE: Final = "kimi_k3"
DEFAULT_IMAGE_PLACEHOLDER: Final = "<|kimi_image_placeholder|>"
_NAME_MARKERS: Final = ("kimi-k3", "kimi_k3", "kimik3")
VALID_EFFORTS: Final = ("low", "high", "max")
SERVED_ROLES: Final = ("system", "developer", "user", "assistant", "tool")

EFFORT_BODY: Final = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
STATIC_TOOLS_BODY: Final = (
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
)
DYNAMIC_TOOLS_BODY: Final = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools."
    "\n\n```json\n{tools}\n```"
)
TOOL_CHOICE_BODIES: Final = {
    "required": (
        "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
    ),
    "none": (
        "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
    ),
}
RESPONSE_FORMAT_BODY: Final = (
    "The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data "
    "without markdown code blocks (```json) or any additional formatting."
)
JSON_SCHEMA_SUFFIX: Final = "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"


def is_kimi_k3(model_type: str | None, display_name: str) -> bool:
    """config.json ``model_type == "kimi_k3"``; only without a model_type, the served name decides."""
    if model_type is not None:
        return model_type == MODEL_TYPE
    name = display_name.lower()
    return any(marker in name for marker in _NAME_MARKERS)


def checkpoint_image_placeholder(config: Mapping[str, Any]) -> str | None:
    """The per-image string the checkpoint itself expects in the prompt (what vLLM expands).

    config.json ``image_placeholder`` when it is a non-empty string; else ``DEFAULT_IMAGE_PLACEHOLDER``
    for a Kimi-K3 ``model_type``; else None (a chat template places its own image tokens).
    """
    placeholder = config.get("image_placeholder")
    if isinstance(placeholder, str) and placeholder:
        return placeholder
    if config.get("model_type") == MODEL_TYPE:
        return DEFAULT_IMAGE_PLACEHOLDER
    return None


class _Unset:
    """Marks ``response_schema`` as not given, so it is taken from ``response_format``."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Final = _Unset()


class _Args(NamedTuple):
    """Normalized tool-call arguments: a dict, or the raw string that did not parse."""

    values: dict[Any, Any]
    raw: str | None


_Item = tuple[int, Any]
"""A message with its position in the request (``enumerate``'s pairs), so errors name what the
client sent."""


def _show(value: object, limit: int = 80) -> str:
    """A client value for an error message: short, and never itself an error (huge ints, deep nesting)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{_type_name(value)}>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _deep_sort(value: Any, where: str) -> Any:
    """Key order is part of the prompt, so tools and schemas render the same whatever the client sent."""
    if isinstance(value, dict):
        try:
            keys = sorted(value)
        except TypeError as exc:
            raise PromptRenderError(f"{where}: object keys must be strings") from exc
        return {key: _deep_sort(value[key], where) for key in keys}
    if isinstance(value, list):
        return [_deep_sort(item, where) for item in value]
    return value


def _dumps(value: Any, where: str, *, compact: bool) -> str:
    separators = (",", ":") if compact else None
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators)
    except (TypeError, ValueError) as exc:
        raise PromptRenderError(f"{where}: cannot be written as JSON ({exc})") from exc


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _function(call: dict[str, Any]) -> Any:
    return call.get("function", call)


# ----------------------------------------------------------------------------- preprocessing


def _call_index(tool_calls: Any) -> dict[str, tuple[int, Any]]:
    """``str(id)`` -> (1-based position, name) for an assistant's calls; the first duplicate wins."""
    index: dict[str, tuple[int, Any]] = {}
    if not isinstance(tool_calls, list):
        return index
    for position, call in enumerate(tool_calls, 1):
        if not isinstance(call, dict) or call.get("id") is None:
            continue
        function = call.get("function")
        name = function.get("name") if isinstance(function, dict) else call.get("name")
        index.setdefault(str(call["id"]), (position, name))
    return index


def _sorted_run(run: list[_Item], calls: dict[str, tuple[int, Any]]) -> list[_Item]:
    """Results in call order when every one matches a call; otherwise exactly as they came."""
    matches: list[tuple[int, int, _Item, Any]] = []
    for offset, item in enumerate(run):
        call_id = item[1].get("tool_call_id")
        if call_id is None:
            call_id = item[1].get("id")
        match = calls.get(str(call_id)) if call_id is not None else None
        if match is None:
            return run
        matches.append((match[0], offset, item, match[1]))
    matches.sort(key=lambda entry: (entry[0], entry[1]))
    out = []
    for _, _, (at, original), name in matches:
        message = {**original, "tool": name}
        if "name" in message:
            message["name"] = name
        out.append((at, message))
    return out


def _resort_tool_results(items: list[_Item]) -> list[_Item]:
    """The reference re-sorts each run of tool results into its assistant's call order."""
    out: list[_Item] = []
    run: list[_Item] = []
    calls: dict[str, tuple[int, Any]] = {}
    for item in items:
        role = _role(item[1])
        if role == "tool":
            run.append(item)
            continue
        if run:
            out.extend(_sorted_run(run, calls))
            run = []
        if role == "assistant":
            calls = _call_index(item[1].get("tool_calls"))
        out.append(item)
    if run:
        out.extend(_sorted_run(run, calls))
    return out


def _normalize_arguments(arguments: Any, where: str) -> _Args:
    if arguments is None:
        return _Args({}, None)
    if isinstance(arguments, dict):
        return _Args(arguments, None)
    if not isinstance(arguments, str):
        raise PromptRenderError(
            f"{where}: arguments must be a JSON object, a string holding one, or null; "
            f"got {_type_name(arguments)}"
        )
    if not arguments.strip():
        return _Args({}, None)
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return _Args({}, arguments)
    if not isinstance(parsed, dict):
        raise PromptRenderError(
            f"{where}: arguments must be a JSON object; the string holds a JSON {_type_name(parsed)}"
        )
    return _Args(parsed, None)


def _normalize_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise PromptRenderError(f"{where} must be an object, got {_type_name(call)}")
    function = _function(call)
    if not isinstance(function, dict):
        raise PromptRenderError(f"{where}: 'function' must be an object, got {_type_name(function)}")
    normalized = {**function, "arguments": _normalize_arguments(function.get("arguments"), where)}
    return {**call, "function": normalized} if "function" in call else normalized


def _normalize_message(item: _Item) -> _Item:
    """Deep-sorts message tools and parses tool-call arguments, on a copy (when there is any)."""
    at, message = item
    if not isinstance(message, dict):
        return item
    tool_calls = message.get("tool_calls")
    if message.get("tools") is None and not tool_calls:
        return item  # nothing to normalize: rendering never mutates a message
    message = dict(message)
    if message.get("tools") is not None:
        message["tools"] = _deep_sort(message["tools"], f"messages[{at}].tools")
    if tool_calls:
        if not isinstance(tool_calls, list):
            raise PromptRenderError(
                f"messages[{at}].tool_calls: expected a list, got {_type_name(tool_calls)}"
            )
        message["tool_calls"] = [
            _normalize_call(call, f"messages[{at}]: tool call {k}") for k, call in enumerate(tool_calls, 1)
        ]
    return at, message


def _schema_from(response_format: Any) -> Any:
    """Rule 1.8.4: ``json_schema.schema``, else ``json_schema.json_schema``, else ``json_schema``."""
    js = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if js is None:
        return None
    if isinstance(js, dict):
        return js.get("schema", js.get("json_schema", js))
    return getattr(js, "schema", None) or getattr(js, "json_schema", None) or js


def _split_partial(items: list[_Item]) -> tuple[list[_Item], _Item | None]:
    """Kimi partial mode: a final assistant message with ``"partial": true`` stays open."""
    partial = [item for item in items if isinstance(item[1], dict) and item[1].get("partial") is True]
    if not partial:
        return items, None
    item = partial[0]
    at, message = item
    where = f"messages[{at}]"
    if item is not items[-1]:
        raise PromptRenderError(f"{where}: only the final message can be partial")
    if _role(message) != "assistant":
        raise PromptRenderError(f"{where}: only an assistant message can be partial")
    if message.get("tool_calls"):
        raise PromptRenderError(f"{where}: a partial assistant message cannot carry tool_calls")
    return items[:-1], item


def check_effort(thinking: Any, effort: Any, field: str = "thinking_effort") -> None:
    """The reference asserts the effort only while thinking; ``medium`` is advertised but rejected."""
    if thinking and effort is not None and effort not in VALID_EFFORTS:
        raise PromptRenderError(
            f"{field} {_show(effort)} is not supported; use one of {', '.join(VALID_EFFORTS)}"
        )


# ----------------------------------------------------------------------------- constant runs
#
# Almost every segment of a K3 prompt is structure that never changes: markers, tag names,
# attribute names and quotes, whole frames such as ``<|open|>message role="user"<|sep|>`` (seven
# segments). They are built once here as ``Run`` constants; a render lists them whole among its
# pieces, and the tokenizer serves each with one lookup. Segment boundaries stay the reference's.

OPEN_SEGMENT: Final = Segment(OPEN, True)
CLOSE_SEGMENT: Final = Segment(CLOSE, True)
SEP_SEGMENT: Final = Segment(SEP, True)
END_OF_MSG_SEGMENT: Final = Segment(END_OF_MSG, True)
QUOTE_OPEN: Final = Segment('="', False)
QUOTE_CLOSE: Final = Segment('"', False)
# ``_new_segment(Segment, (text, flag))`` is ``Segment(text, flag)`` without NamedTuple's
# Python-level ``__new__``: every text segment of every request is built this way.
_new_segment: Final = tuple.__new__


def _attr(key: str, value: str) -> tuple[Segment, ...]:
    """`` key="value"`` as the reference writes it: four text segments, three for an empty value."""
    escaped = _escape(value)
    value_segments = (Segment(escaped, False),) if escaped else ()
    return (Segment(" " + key, False), QUOTE_OPEN, *value_segments, QUOTE_CLOSE)


def _open(tag: str, *attrs: tuple[str, str], sep: bool = True) -> tuple[Segment, ...]:
    """``<|open|>tag key="value"...<|sep|>``; with ``sep=False`` the head of a frame that goes on."""
    segments = [OPEN_SEGMENT, Segment(tag, False)]
    for key, value in attrs:
        segments.extend(_attr(key, value))
    if sep:
        segments.append(SEP_SEGMENT)
    return tuple(segments)


def _close(tag: str) -> tuple[Segment, ...]:
    return (CLOSE_SEGMENT, Segment(tag, False), SEP_SEGMENT)


def _internal_message(kind: str, body: str) -> Run:
    """A whole internal system message whose body is constant."""
    body_segments = (Segment(body, False),) if body else ()
    return Run((*INTERNAL_OPENS[kind].segments, *body_segments, *MESSAGE_CLOSE.segments))


def _attr_open(key: str) -> Run:
    """`` key="`` of an attribute whose value varies."""
    return Run((Segment(" " + key, False), QUOTE_OPEN))


MESSAGE_CLOSE: Final = Run((*_close("message"), END_OF_MSG_SEGMENT))
_ROLES: Final = ("system", "user", "assistant", "tool")
MESSAGE_HEADS: Final = {role: Run(_open("message", ("role", role), sep=False)) for role in _ROLES}
MESSAGE_OPENS: Final = {role: Run(_open("message", ("role", role))) for role in _ROLES}
INTERNAL_OPENS: Final = {
    kind: Run(_open("message", ("role", "system"), ("type", kind)))
    for kind in ("tool-declare", "thinking-effort", "tool-choice", "response-format")
}
NAME_OPEN, TOOL_OPEN, INDEX_OPEN, KEY_OPEN = (_attr_open(key) for key in ("name", "tool", "index", "key"))
THINK_OPEN, THINK_CLOSE = Run(_open("think")), Run(_close("think"))
RESPONSE_OPEN, RESPONSE_CLOSE = Run(_open("response")), Run(_close("response"))
TOOLS_OPEN, TOOLS_CLOSE = Run(_open("tools")), Run(_close("tools"))
CALL_HEAD, CALL_CLOSE = Run(_open("call", sep=False)), Run(_close("call"))
ARGUMENT_HEAD, ARGUMENT_CLOSE = Run(_open("argument", sep=False)), Run(_close("argument"))
ARGUMENT_TYPE_TAILS: Final = {
    kind: Run((*_attr("type", kind), SEP_SEGMENT))
    for kind in ("boolean", "null", "number", "string", "object", "array")
}
RAW_ARGUMENTS_OPEN, RAW_ARGUMENTS_CLOSE = Run(_open("json", ("type", "object"))), Run(_close("json"))
EFFORT_MESSAGES: Final = {
    effort: _internal_message("thinking-effort", EFFORT_BODY.format(effort=effort).strip())
    for effort in VALID_EFFORTS
}
TOOL_CHOICE_MESSAGES: Final = {
    choice: _internal_message("tool-choice", body.strip()) for choice, body in TOOL_CHOICE_BODIES.items()
}


# ----------------------------------------------------------------------------- emission


class _Writer:
    """Collects the prompt's pieces: constant runs and single segments, in order.

    Only structural markers and the image token are ever control segments.
    """

    def __init__(self, image_token: str, thinking: bool) -> None:
        self.image_segment = Segment(image_token, True)
        self.thinking = thinking
        self.pieces: list[Piece] = []
        self.emit = self.pieces.append
        self.image_count = 0
        self.open_channel: str | None = None  # the output channel the prompt leaves open

    def text(self, value: Any) -> None:
        text = str(value)
        if text:
            self.emit(_new_segment(Segment, (text, False)))

    def attr(self, key_open: Run, value: Any) -> None:
        """A variable attribute: `` key="value"`` with the value escaped (an empty one is dropped)."""
        self.emit(key_open)
        escaped = _escape(str(value))
        if escaped:
            self.emit(_new_segment(Segment, (escaped, False)))
        self.emit(QUOTE_CLOSE)

    def message_open(self, role: str, message: dict[str, Any]) -> None:
        name = message.get("name")
        if not name:
            self.emit(MESSAGE_OPENS[role])
            return
        self.emit(MESSAGE_HEADS[role])
        self.attr(NAME_OPEN, name)
        self.emit(SEP_SEGMENT)

    def internal(self, kind: str, body: str) -> None:
        self.emit(INTERNAL_OPENS[kind])
        self.text(body)
        self.emit(MESSAGE_CLOSE)

    def content(self, content: Any, at: int) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        if not isinstance(content, list):
            raise PromptRenderError(
                f"messages[{at}].content: expected a string, a list of content parts or null, "
                f"got {_type_name(content)}"
            )
        for j, part in enumerate(content):
            self.part(part, at, j)

    def part(self, part: Any, at: int, j: int) -> None:
        if isinstance(part, dict) and "type" in part:
            if part["type"] in IMAGE_PART_TYPES:
                self.emit(self.image_segment)
                self.image_count += 1
                return
            if "text" in part:
                self.text(part["text"])
                return
        where = f"messages[{at}].content[{j}]"
        if not isinstance(part, dict):
            raise PromptRenderError(f"{where}: expected a content part object, got {_type_name(part)}")
        if "type" not in part:
            raise PromptRenderError(f"{where}: content part has no 'type'")
        raise PromptRenderError(f"{where}: content part of type {_show(part['type'])} has no 'text'")

    def plain(self, at: int, message: dict[str, Any], role: str) -> None:
        self.message_open(role, message)
        self.content(message.get("content"), at)
        self.emit(MESSAGE_CLOSE)

    def think(self, message: dict[str, Any]) -> None:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        self.emit(THINK_OPEN)
        if reasoning is not None:
            text = str(reasoning)
            if text.strip():
                self.emit(_new_segment(Segment, (text, False)))
        self.emit(THINK_CLOSE)

    def response(self, at: int, message: dict[str, Any]) -> None:
        """The assistant frame, reasoning and response channel, left open (partial mode's tail)."""
        self.message_open("assistant", message)
        if self.thinking:
            self.think(message)
        self.emit(RESPONSE_OPEN)
        self.content(message.get("content"), at)

    def assistant(self, at: int, message: dict[str, Any]) -> None:
        self.response(at, message)
        self.emit(RESPONSE_CLOSE)
        tool_calls = message.get("tool_calls")
        if tool_calls:
            self.tool_calls(at, tool_calls)
        self.emit(MESSAGE_CLOSE)

    def tool_calls(self, at: int, calls: list[dict[str, Any]]) -> None:
        self.emit(TOOLS_OPEN)
        for k, call in enumerate(calls, 1):
            function = _function(call)
            if "name" not in function:
                raise PromptRenderError(f"messages[{at}]: tool call {k} has no function name")
            self.emit(CALL_HEAD)
            self.attr(TOOL_OPEN, function["name"])
            self.attr(INDEX_OPEN, k)
            self.emit(SEP_SEGMENT)
            self.arguments(function["arguments"], at, k)
            self.emit(CALL_CLOSE)
        self.emit(TOOLS_CLOSE)

    def arguments(self, args: _Args, at: int, k: int) -> None:
        if args.raw is not None:
            self.emit(RAW_ARGUMENTS_OPEN)
            self.text(args.raw)
            self.emit(RAW_ARGUMENTS_CLOSE)
            return
        for key, value in args.values.items():
            self.emit(ARGUMENT_HEAD)
            self.attr(KEY_OPEN, key)
            self.emit(ARGUMENT_TYPE_TAILS[_xtml_type(value)])
            if isinstance(value, str):
                self.text(value)
            else:
                self.text(
                    _dumps(value, f"messages[{at}]: tool call {k} argument {_show(key)}", compact=False)
                )
            self.emit(ARGUMENT_CLOSE)

    def tool_result(self, at: int, message: dict[str, Any], position: int, last_calls: Any) -> None:
        name = message.get("tool", message.get("name"))
        if name is None:
            name = _name_by_order(at, position, last_calls)
        self.emit(MESSAGE_HEADS["tool"])
        self.attr(TOOL_OPEN, name)
        self.attr(INDEX_OPEN, position)
        self.emit(SEP_SEGMENT)
        self.content(message.get("content"), at)
        self.emit(MESSAGE_CLOSE)


def _name_by_order(index: int, position: int, last_calls: Any) -> Any:
    if isinstance(last_calls, list) and position <= len(last_calls):
        call = last_calls[position - 1]
        function = _function(call) if isinstance(call, dict) else None
        if isinstance(function, dict) and "name" in function:
            return function["name"]
    raise PromptRenderError(
        f"messages[{index}]: tool result {position} has no resolvable tool name; set 'tool' or 'name', "
        "or send it after an assistant message whose tool call at the same position it answers"
    )


def _emit_messages(writer: _Writer, items: list[_Item]) -> None:
    position = 0
    last_calls: Any = None
    for at, message in items:
        if not isinstance(message, dict):
            continue
        if "role" not in message:
            raise PromptRenderError(f"messages[{at}]: missing 'role'")
        role = message["role"]
        if role == "system" and message.get("tools"):
            tools = _dumps(message["tools"], f"messages[{at}].tools", compact=True)
            writer.internal("tool-declare", DYNAMIC_TOOLS_BODY.format(tools=tools))
        elif role == "user":
            writer.plain(at, message, "user")
        elif role == "system":
            writer.plain(at, message, "system")
        elif role == "assistant":
            position, last_calls = 0, message.get("tool_calls")
            writer.assistant(at, message)
        elif role == "tool":
            position += 1
            writer.tool_result(at, message, position, last_calls)


def _emit_effort(writer: _Writer, effort: Any) -> None:
    """The thinking-effort message; ``check_effort`` has already held ``effort`` to VALID_EFFORTS."""
    if type(effort) is str:
        writer.emit(EFFORT_MESSAGES[effort])
    else:
        writer.internal("thinking-effort", EFFORT_BODY.format(effort=effort).strip())


def _emit_response_format(writer: _Writer, response_format: Any, schema: Any) -> None:
    kind = (
        response_format.get("type", response_format) if isinstance(response_format, dict) else response_format
    )
    if kind == "json_object":
        writer.internal("response-format", RESPONSE_FORMAT_BODY.format(kind=kind).strip())
    elif kind == "json_schema":
        suffix = JSON_SCHEMA_SUFFIX.format(schema=_dumps(schema, "response_format", compact=True))
        writer.internal("response-format", (RESPONSE_FORMAT_BODY.format(kind=kind) + suffix).strip())


class KimiK3Formatter:
    """Renders chat requests as Kimi-K3 XTML segments (reference encoder semantics)."""

    kind = "kimi_k3"

    def __init__(
        self,
        image_placeholder_token: str | None = None,
        *,
        default_image_placeholder: str = DEFAULT_IMAGE_PLACEHOLDER,
        generation_prompt: Literal["reference", "hosted"] = "reference",
    ) -> None:
        if generation_prompt not in ("reference", "hosted"):
            raise ValueError(f"generation_prompt must be 'reference' or 'hosted', got {generation_prompt!r}")
        if not (image_placeholder_token or default_image_placeholder):
            raise ValueError("an image placeholder token is needed: declare one or keep the default")
        self.rendered_token: str = image_placeholder_token or default_image_placeholder
        self.generation_prompt = generation_prompt

    def render_segments(
        self,
        messages: Sequence[Any],
        tools: Any = None,
        *,
        add_generation_prompt: bool = True,
        thinking: bool = True,
        thinking_effort: Any = "max",
        tool_choice: Any = None,
        response_format: Any = None,
        response_schema: Any = UNSET,
    ) -> list[Segment]:
        """The reference ``build_chat_segments`` output, image parts rendered as ``image_token``."""
        writer = self._render(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            thinking_effort=thinking_effort,
            tool_choice=tool_choice,
            response_format=response_format,
            response_schema=response_schema,
        )
        return flatten(writer.pieces)

    def with_tokenizer_specials(self, specials: Iterable[str]) -> KimiK3Formatter:
        """Unchanged: K3 control segments are explicit, whatever else the tokenizer registers."""
        del specials
        return self

    def render(self, request: ChatCompletionRequest) -> RenderedPrompt:
        """Shapes the request as a serving layer does (section 1.13), then renders it."""
        args = template_args_of(request)  # read: thinking, enable_thinking (bools), thinking_effort (an enum)
        thinking = _thinking_from(args, request.reasoning_effort)
        effort, effort_field = _effort_from(args, request.reasoning_effort)
        check_effort(thinking, effort, effort_field)
        writer = self._render(
            _served_messages(request.messages),
            request.tools,
            add_generation_prompt=request.add_generation_prompt,
            thinking=thinking,
            thinking_effort=effort,
            tool_choice=request.tool_choice,
            response_format=request.response_format,
            response_schema=UNSET,
        )
        pieces = writer.pieces
        text = "".join([piece.text for piece in pieces])
        return RenderedPrompt(
            text=text, pieces=pieces, image_count=writer.image_count, open_channel=writer.open_channel
        )

    def _render(
        self,
        messages: Sequence[Any],
        tools: Any,
        *,
        add_generation_prompt: bool,
        thinking: bool,
        thinking_effort: Any,
        tool_choice: Any,
        response_format: Any,
        response_schema: Any,
    ) -> _Writer:
        if not isinstance(messages, list | tuple):
            raise PromptRenderError(f"messages: expected a list of messages, got {_type_name(messages)}")
        try:
            items = _resort_tool_results(list(enumerate(messages)))
            items = [_normalize_message(item) for item in items]
            tools = _deep_sort(tools, "tools")
            if response_schema is UNSET:
                response_schema = _schema_from(response_format)
            response_schema = _deep_sort(response_schema, "response_format")
            items, partial = _split_partial(items)
            writer = _Writer(self.rendered_token, bool(thinking))
            if tools:
                declared = _dumps(tools, "tools", compact=True)
                writer.internal("tool-declare", STATIC_TOOLS_BODY.format(tools=declared))
            check_effort(thinking, thinking_effort)
            if thinking and thinking_effort is not None:
                _emit_effort(writer, thinking_effort)
            _emit_messages(writer, items)
            if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_MESSAGES:
                writer.emit(TOOL_CHOICE_MESSAGES[tool_choice])
            _emit_response_format(writer, response_format, response_schema)
            self._emit_tail(writer, partial, add_generation_prompt)
        except RecursionError as exc:
            raise PromptRenderError("the request is nested too deeply to render") from exc
        except PromptRenderError:
            raise
        except ValueError as exc:
            raise PromptRenderError(f"the request cannot be rendered: {exc}") from exc
        return writer

    def _emit_tail(self, writer: _Writer, partial: _Item | None, add_generation_prompt: bool) -> None:
        if partial is not None:
            writer.response(*partial)
            writer.open_channel = "response"
            return
        if not add_generation_prompt:
            return
        writer.emit(MESSAGE_OPENS["assistant"])
        if self.generation_prompt == "reference":
            writer.open_channel = "think" if writer.thinking else "response"
            writer.emit(THINK_OPEN if writer.thinking else RESPONSE_OPEN)


# ----------------------------------------------------------------------------- serving layer


def _served_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """``developer`` becomes ``system`` (tools kept); anything the encoder would skip is an error."""
    if not isinstance(messages, list | tuple):
        raise PromptRenderError(f"messages: expected a list of messages, got {_type_name(messages)}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptRenderError(f"messages[{i}]: expected a message object, got {_type_name(message)}")
        if "role" not in message:
            raise PromptRenderError(f"messages[{i}]: missing 'role'")
        role = message["role"]
        if role not in SERVED_ROLES:
            raise PromptRenderError(
                f"messages[{i}].role: {_show(role)} is not supported; use one of {', '.join(SERVED_ROLES)}"
            )
        out.append({**message, "role": "system"} if role == "developer" else message)
    return out


def _thinking_from(args: dict[str, Any], reasoning_effort: str | None) -> Any:
    """``thinking`` (or ``enable_thinking``) wins; otherwise only ``reasoning_effort="none"`` turns it off."""
    for key in ("thinking", "enable_thinking"):
        value = args.get(key)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise PromptRenderError(f"chat_template_args.{key} must be true or false, got {_show(value)}")
        return value
    return reasoning_effort != "none"


def _effort_from(args: dict[str, Any], reasoning_effort: str | None) -> tuple[Any, str]:
    """An explicit ``thinking_effort`` (None included) wins over ``reasoning_effort``; default ``max``."""
    if "thinking_effort" in args:
        return args["thinking_effort"], "thinking_effort"
    if reasoning_effort is not None and reasoning_effort != "none":
        return reasoning_effort, "reasoning_effort"
    return "max", "thinking_effort"
