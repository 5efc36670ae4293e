"""Argument values typed by the declared tool's JSON schema, as vLLM types them (formats whose values
are raw text, such as Qwen3-Coder's ``<parameter=K>VALUE</parameter>``).

A value whose property schema is known is converted to the first of its types that reads it, in
vLLM's order (null, integer, number, boolean, object, array, string); a value no type reads is
JSON if it parses as finite JSON, else the string. A value without a schema stays a string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

__all__ = ["NO_TOOLS", "ToolProperties", "tool_properties", "typed_arguments", "typed_value"]

ToolProperties = Mapping[str, Mapping[str, Any]]
"""Each declared function tool's ``parameters.properties`` by its name (the first tool of a name)."""
NO_TOOLS: Final[ToolProperties] = MappingProxyType({})

_PRIORITY: Final = ("null", "integer", "number", "boolean", "object", "array", "string")
_ALIASES: Final = MappingProxyType(
    {
        **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
        **dict.fromkeys(
            ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"
        ),
        **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
        "bool": "boolean",
        "dict": "object",
        **dict.fromkeys(("arr", "list", "sequence"), "array"),
    }
)
_MAX_SCHEMA_DEPTH: Final = 32  # anyOf/oneOf/allOf nesting read for types (deeper: ignored)
_ENUM_TYPES: Final = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))


def tool_properties(tools: Sequence[Any] | None) -> ToolProperties:
    """The ``properties`` of each function tool of a chat request's ``tools``, by name."""
    found: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name in found:
            continue
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found[name] = properties if isinstance(properties, dict) else {}
    return MappingProxyType(found) if found else NO_TOOLS


def typed_value(text: str, schema: Any) -> Any:
    """``text`` read as its property ``schema`` types it (vLLM's ``coerce_to_schema_type``)."""
    if not isinstance(schema, Mapping):
        return text
    types = {_ALIASES.get(kind.strip().lower(), kind.strip().lower()) for kind in _types(schema, 0)}
    for kind in _PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return text
        found, value = _read(kind, text)
        if found:
            return value
    value = _finite_json(text)
    return text if value is _NOT_JSON else value


_NOT_JSON: Final = object()


def _read(kind: str, text: str) -> tuple[bool, Any]:
    if kind == "null":
        return text.lower() == "null", None
    if kind == "integer":
        try:
            return True, int(text)
        except ValueError:
            return False, None
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return False, None
        if not math.isfinite(number):
            return False, None
        return True, number if number != int(number) else int(number)
    if kind == "boolean":
        word = text.lower().strip()
        return word in ("true", "1", "false", "0"), word in ("true", "1")
    value = _finite_json(text)  # object, array: any finite JSON value, as vLLM reads them
    return value is not _NOT_JSON, value


def _finite_json(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON
    return value if _finite(value) else _NOT_JSON


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in ``value`` (iteratively: a deep value costs no recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _types(schema: Mapping[str, Any], depth: int) -> list[str]:
    """The type names a property schema allows: ``type``, ``enum`` values, ``anyOf``/``oneOf``/
    ``allOf`` branches; ``string`` when it says none."""
    types: list[str] = []
    kind = schema.get("type")
    if isinstance(kind, str):
        types.append(kind)
    elif isinstance(kind, list):
        types += [item for item in kind if isinstance(item, str)]
    enum = schema.get("enum")
    if isinstance(enum, list):
        types += [_enum_type(value) for value in enum]
    if depth < _MAX_SCHEMA_DEPTH:
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            if isinstance(branches, list):
                for branch in branches:
                    types += _types(branch, depth + 1) if isinstance(branch, Mapping) else ["string"]
    return types or ["string"]


def _enum_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)), "string")


def typed_arguments(values: dict[str, str], properties: Any) -> str:
    """The arguments object of raw values, each typed by its property schema when the tool has one
    (vLLM's types), compact."""
    arguments: dict[str, Any] = dict(values)
    if isinstance(properties, dict) and properties:
        arguments = {key: typed_value(text, properties.get(key)) for key, text in values.items()}
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
