"""What the JSON tool-call formats share: a call object's name and arguments, and where a streamed
JSON object ends."""

from __future__ import annotations

import re
from typing import Any

from dynamo_prep.parsing import _json

__all__ = ["ObjectEnd", "call_of", "json_call"]

ARGUMENT_KEYS = ("arguments", "parameters")


def json_call(body: str, *, arguments_required: bool) -> tuple[str, str] | None:
    """(name, arguments) of ``{"name": N, "arguments"|"parameters": {...}}``, or None when ``body`` is
    no such object.

    ``arguments`` (the first of the two keys present) keeps the model's spelling, compacted
    lexically; a string holding a JSON object is accepted too; null, or a missing key unless
    ``arguments_required``, means ``{}``. Any other value is no call (OpenAI arguments are an object).
    """
    try:
        value = _json.loads(body)
    except _json.JsonError:
        return None
    return call_of(value, body, arguments_required=arguments_required)


def call_of(value: Any, body: str, *, arguments_required: bool) -> tuple[str, str] | None:
    """``json_call`` of an object already parsed: ``value`` is ``_json.loads(body)``."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if arguments_required and not any(key in value for key in ARGUMENT_KEYS):
        return None
    members = dict(_json.members(_json.compact(body)))
    arguments = members.get(ARGUMENT_KEYS[0], members.get(ARGUMENT_KEYS[1]))
    if arguments is None or arguments == "null":
        return value["name"], "{}"
    if arguments.startswith("{"):
        return value["name"], arguments
    if arguments.startswith('"'):
        inner = _json.loads(arguments)
        if isinstance(inner, str) and _json.is_object(inner):
            return value["name"], _json.compact(inner)
    return None


_OUTSIDE = re.compile(r'[{}\[\]"]')
_INSIDE = re.compile(r'[\\"]')


class ObjectEnd:
    """Where a JSON value that opens with ``{`` or ``[`` closes, fed its text piece by piece: each
    character is looked at once (strings and escapes are skipped, brackets counted)."""

    __slots__ = ("_depth", "_escaped", "_in_string")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str, at: int = 0) -> int:
        """The index in ``text`` just past the outermost close, or -1 while it is still open."""
        size = len(text)
        while at < size:
            if self._escaped:
                self._escaped = False
                at += 1
                continue
            if self._in_string:
                found = _INSIDE.search(text, at)
                if found is None:
                    return -1
                at = found.end()
                if found.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                continue
            found = _OUTSIDE.search(text, at)
            if found is None:
                return -1
            at = found.end()
            char = found.group()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return at
        return -1
