"""Argument values that a format writes as untyped text (GLM-4.5's ``<arg_value>``), typed by the
request's tool schemas the way vLLM types them (``coerce_to_schema_type``): a parameter declared
``integer`` reads ``3`` as 3, one declared ``string`` (or without a schema) keeps ``"3"``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from dynamo_prep.parsing import _json

__all__ = ["Tools", "parameter_types", "typed_value"]

Tools = Sequence[Mapping[str, Any]]
"""The request's ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` objects)."""

MAX_SCHEMA_NODES: Final = 256
"""How many ``anyOf``/``oneOf``/``allOf`` branches of one parameter's schema are read for its types."""
_PRIORITY: Final = ("null", "integer", "number", "boolean", "object", "array", "string")
_ALIASES: Final = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ENUM_TYPES: Final = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))


def parameter_types(tools: Tools, name: str) -> dict[str, frozenset[str]]:
    """The JSON types of each top-level parameter of the tool called ``name`` (empty: no such tool
    or no ``properties``); a parameter whose schema says no type is a string."""
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            if not isinstance(properties, Mapping):
                return {}
            return {str(key): _types(schema) for key, schema in properties.items()}
    return {}


def _types(schema: Any) -> frozenset[str]:
    """vLLM's ``extract_types_from_schema``: ``type`` (a name or a list), the types of ``enum``
    values, and those of ``anyOf``/``oneOf``/``allOf`` branches (at most ``MAX_SCHEMA_NODES``)."""
    found: set[str] = set()
    pending, seen = [schema], 0
    while pending and seen < MAX_SCHEMA_NODES:
        node = pending.pop()
        seen += 1
        if not isinstance(node, Mapping):
            continue
        kind = node.get("type")
        found.update(
            [kind]
            if isinstance(kind, str)
            else [k for k in kind if isinstance(k, str)]
            if isinstance(kind, list)
            else []
        )
        enum = node.get("enum")
        if isinstance(enum, list):
            found.update(_enum_type(value) for value in enum)
        for branch in ("anyOf", "oneOf", "allOf"):
            if isinstance(choices := node.get(branch), list):
                pending.extend(choices)
    return frozenset(found or ("string",))


def _enum_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list | dict):
        return "array" if isinstance(value, list) else "object"
    return next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)), "string")


def typed_value(value: str, types: frozenset[str] | None) -> str:
    """``value`` as the JSON text of its parameter's type: the first of null, integer, number,
    boolean, object, array, string (in that order) that the declared types allow and the text reads
    as; a string when none does, or when the parameter has no schema (``types`` None)."""
    if types is None:
        return _json.dumps_string(value)
    wanted = {_ALIASES.get(name.strip().lower(), name.strip().lower()) for name in types}
    for candidate in _PRIORITY:
        if candidate in wanted and (text := _as(candidate, value)) is not None:
            return text
    if (text := _json_value(value)) is not None:  # vLLM: any other declared type reads JSON
        return text
    return _json.dumps_string(value)


def _as(candidate: str, value: str) -> str | None:
    """``value`` as JSON text of ``candidate``, or None when it does not read as one."""
    if candidate == "string":
        return _json.dumps_string(value)
    if candidate == "null":
        return "null" if value.lower() == "null" else None
    if candidate == "boolean":
        word = value.lower().strip()
        return "true" if word in ("true", "1") else "false" if word in ("false", "0") else None
    try:
        if candidate == "integer":
            return str(int(value))
        if candidate == "number":
            number = float(value)
            if not math.isfinite(number):
                return None
            return str(int(number)) if number == int(number) else json.dumps(number)
    except (ValueError, OverflowError):
        return None
    text = _json_value(value)
    return text if text is not None and text[0] == ("{" if candidate == "object" else "[") else None


def _json_value(value: str) -> str | None:
    """``value`` compacted, when it is strict JSON with finite numbers."""
    try:
        parsed = _json.loads(value)
    except _json.JsonError:
        return None
    return _json.compact(value.strip()) if _finite(parsed) else None


def _finite(value: Any) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return True
