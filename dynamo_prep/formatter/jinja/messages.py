"""OpenAI chat messages as vLLM 0.32 hands them to a chat template (rules: docs/formatters.md).

``vllm_messages`` rebuilds each message with the keys vLLM keeps, its content in the template's
content format (``content_format``), assistant tool-call arguments as objects, and, for a template
that does not name the developer role, developer messages as one leading system message. A plain
message (a role and string content) takes a short inline path. The request is never modified. A
shape vLLM refuses, or one dynamo_prep cannot render, is a ``PromptRenderError`` (a 400 on
``messages``). Tool calls take the key order vLLM's request model gives them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import structlog

from dynamo_prep.formatter.jinja.content_format import (
    ContentFormat,
    detect_content_format,
    knows_developer_role,
)
from dynamo_prep.prompt import PromptRenderError

__all__ = ["MessageRules", "message_rules", "vllm_messages"]

log = structlog.get_logger("dynamo_prep.formatter")

_BILLING_HEADER = "x-anthropic-billing-header"  # a system text line vLLM drops (it changes per request)
# tuples, not sets: a client's unhashable role or ``type`` may be tested against them
_PLAIN_ROLES = ("user", "assistant", "system", "tool")
_IMAGE_TYPES = ("image_url", "image")
# Key orders of vLLM's request model (its TypedDicts): a tool call, its function, a developer's tool.
_CALL_KEYS = ("id", "function", "type")
_FUNCTION_CALL_KEYS = ("arguments", "name")
_TOOL_KEYS = ("function", "type")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# Part keys vLLM reads itself; a text or image part keeps every other key beside its type.
_KNOWN_PART_KEYS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class MessageRules:
    """What vLLM reads from a template, once per template: its content format, whether it names
    the developer role."""

    content_format: ContentFormat
    knows_developer: bool


# The four possible rules, shared: a served model keeps no object of its own for them.
_RULES = {
    (content_format, knows): MessageRules(content_format, knows)
    for content_format in ("string", "openai")
    for knows in (False, True)
}


def message_rules(environment: jinja2.Environment, source: str | None) -> MessageRules:
    """The template's rules; without its source, vLLM's default ("string", developer converted)."""
    if source is None:
        return _RULES["string", False]
    return _RULES[detect_content_format(environment, source), knows_developer_role(source)]


def vllm_messages(messages: Sequence[Any], rules: MessageRules) -> list[dict[str, Any]]:
    """The messages vLLM renders for ``messages`` under ``rules``."""
    openai = rules.content_format == "openai"
    converted: list[dict[str, Any]] = []
    developer = False
    for index, message in enumerate(messages):
        if type(message) is dict and len(message) == 2:  # the common case, inline: a role and text
            role = message.get("role")
            content = message.get("content")
            if (
                type(content) is str
                and role in _PLAIN_ROLES
                and not (role == "system" and content.startswith(_BILLING_HEADER))
            ):
                if openai and role != "tool":  # a tool's text parts are joined again: it stays a string
                    content = [{"type": "text", "text": content}]
                converted.append({"role": role, "content": content})
                continue
        converted.append(done := _message(index, message, openai))
        developer = developer or done["role"] == "developer"
    return _one_system(converted) if developer and not rules.knows_developer else converted


def _message(index: int, message: Any, openai: bool) -> dict[str, Any]:
    """One message rebuilt as vLLM's chat parser rebuilds it (its request model's rename included)."""
    if not isinstance(message, dict):
        raise PromptRenderError(f"messages[{index}]: a message must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise PromptRenderError(f"messages[{index}]: a message needs a string 'role'")
    content = _content(index, role, message.get("content"), openai)
    result: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None and (converted := _tool_calls(index, calls)):
            result["tool_calls"] = converted
        reasoning = message.get("reasoning")
        if reasoning is None:  # vLLM's chat request model renames reasoning_content
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if type(content) is list and all(part["type"] == "text" for part in content):
            result["content"] = "\n".join([part["text"] for part in content])
    for key in ("name", "task"):
        if isinstance(value := message.get(key), str):
            result[key] = value
    if role == "developer":
        result["tools"] = _developer_tools(message.get("tools"))
    return result


def _content(index: int, role: str, content: Any, openai: bool) -> str | list[Any]:
    """Content in the template's format: "\\n"-joined text, or text and image parts."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise PromptRenderError(f"messages[{index}].content must be a string, a list of parts or null")
    if role == "system":
        parts = _without_billing_header(parts)
    converted = []
    for part_index, part in enumerate(parts):
        if done := _part(part, openai, index, part_index):  # an empty text is no text ("string" format)
            converted.append(done)
    return converted if openai else "\n".join(converted)


def _part(part: Any, openai: bool, index: int, part_index: int) -> Any:
    """A text part as ``{"type": "text", "text": ...}`` (or its text), an image part as
    ``{"type": "image"}``, each with the part's other keys; None for a text part without text."""
    # Called per part of every list content: the error text is built only when there is an error.
    if type(part) is str:
        return {"type": "text", "text": part} if openai else part
    if type(part) is not dict:
        raise _part_error(index, part_index, "a content part must be an object or a string")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if type(text) is not str:
            if text is None:
                return None
            raise _part_error(index, part_index, "a text part's 'text' must be a string")
        if not openai:
            return text
        if part.keys() <= _KNOWN_PART_KEYS:
            return {"type": "text", "text": text}
        return {"type": "text", "text": text, **_extra_keys(part)}
    if isinstance(kind, str) and kind in _IMAGE_TYPES:
        if not openai:
            raise _part_error(
                index,
                part_index,
                "this model's chat template takes content as text (vLLM's 'string' content format), so it "
                "cannot place image parts",
            )
        return {"type": "image", **_extra_keys(part)}
    raise _part_error(index, part_index, f"unknown content part type {str(kind)[:40]!r}")


def _part_error(index: int, part_index: int, problem: str) -> PromptRenderError:
    return PromptRenderError(f"messages[{index}].content[{part_index}]: {problem}")


def _extra_keys(part: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in part.items() if key not in _KNOWN_PART_KEYS}


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System text without Claude Code's attribution line (its first line, when it starts a part)."""
    kept = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if _is_text(part) else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
        elif rest := text.partition("\n")[2]:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"


def _tool_calls(index: int, calls: Any) -> list[Any]:
    """Assistant tool calls with ``arguments`` as an object: a JSON string parsed; empty, malformed or
    not an object -> ``{}`` (a bad call in the history never blocks the conversation)."""
    if not isinstance(calls, list):
        raise PromptRenderError(f"messages[{index}].tool_calls must be a list")
    converted = []
    for call in calls:
        if not isinstance(call, dict):
            raise PromptRenderError("assistant tool_calls entries must be objects.")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise PromptRenderError("chat completions only support assistant tool_calls of type 'function'.")
        arguments = function.get("arguments")
        if not isinstance(arguments, dict):
            arguments = _arguments(function.get("name"), arguments)
        function = _in_order({**function, "arguments": arguments}, _FUNCTION_CALL_KEYS)
        converted.append(_in_order({**call, "function": function}, _CALL_KEYS))
    return converted


def _in_order(value: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``value`` with ``keys`` first, in that order, as vLLM's request model (pydantic) rebuilds it."""
    return {key: value[key] for key in keys if key in value} | value


def _developer_tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools
    return [
        _in_order({**tool, "function": _in_order(tool["function"], _FUNCTION_KEYS)}, _TOOL_KEYS)
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        else tool
        for tool in tools
    ]


def _arguments(name: Any, arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            log.warning("tool_call_arguments_not_json", function=str(name)[:80], chars=len(arguments))
    return arguments if isinstance(arguments, dict) else {}


def _one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones (their ``tools`` dropped); then, if a system message is not
    first or there are several, all of them as one first message, their texts joined by a blank line."""
    converted = [_as_system(message) if message["role"] == "developer" else message for message in messages]
    systems = [index for index, message in enumerate(converted) if message["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = [text for index in systems if (text := _system_text(converted[index]["content"]))]
    rest = [message for message in converted if message["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    return {key: "system" if key == "role" else value for key, value in message.items() if key != "tools"}


def _system_text(content: Any) -> Any:
    """A system message's text: its string, or its parts' texts joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = [part if isinstance(part, str) else part.get("text") for part in content]
    return "\n".join([text for text in texts if text is not None])
