"""Structured outputs at the edge: a chat request's ``response_format`` and forced ``tool_choice`` as
the one ``StructuredOutput`` the engine constrains its decoding with (docs/structured-outputs.md).

A forced tool choice takes vLLM's OpenAI server's shapes: a named function's output is its
arguments object (its ``parameters`` schema); ``"required"`` is a JSON array of
``{"name", "parameters"}`` calls, one of the tools each. It wins over ``response_format``, as there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from dynamo_prep.protocol.preprocessed import StructuredOutput

__all__ = [
    "ACCEPTED_RESPONSE_FORMATS",
    "ForcedTool",
    "StructuredOutputError",
    "forced_tool",
    "structured_output",
]

ACCEPTED_RESPONSE_FORMATS: Final = (
    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
    '{"name": ..., "schema": {...}, "strict": true|false}}'
)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_OBJECT: Final = {"type": "object", "properties": {}}


class StructuredOutputError(ValueError):
    """A ``response_format`` or a forced tool the engine cannot constrain to; ``param`` names the field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ForcedTool:
    """A forced tool choice: ``name`` for a named function (the output is its arguments), None for
    ``"required"`` (the output is a JSON array of ``{"name", "parameters"}``)."""

    name: str | None


def forced_tool(tool_choice: str | dict[str, Any] | None) -> ForcedTool | None:
    """The forced tool choice of a request already validated (``"required"`` or a named function)."""
    if tool_choice == "required":
        return ForcedTool(None)
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return ForcedTool(function["name"])
    return None


def structured_output(
    response_format: dict[str, Any] | str | None,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    *,
    parallel_tool_calls: bool | None = None,
) -> StructuredOutput | None:
    """The constraint of a request (None: free text); raises ``StructuredOutputError``."""
    from_format = _from_response_format(response_format)
    forced = forced_tool(tool_choice)
    if forced is None or not tools:
        return from_format
    schema = _forced_schema(forced, tools, parallel_tool_calls)
    return StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False))


def _refuse(detail: str) -> StructuredOutputError:
    message = f"Invalid 'response_format': {detail}. Accepted: {ACCEPTED_RESPONSE_FORMATS}."
    return StructuredOutputError(message, param="response_format")


def _from_response_format(response_format: dict[str, Any] | str | None) -> StructuredOutput | None:
    if response_format is None:
        return None
    kind = response_format if isinstance(response_format, str) else response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise _refuse(f"unknown type {kind!r}" if isinstance(kind, str) else "'type' is missing")
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if not isinstance(spec, dict):
        raise _refuse("a json_schema response_format needs a 'json_schema' object")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _refuse("'json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    if spec.get("strict") not in (None, True, False):
        raise _refuse("'json_schema.strict' must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _refuse("'json_schema.schema' must be a JSON Schema object")
    problem = schema_problem(schema)
    if problem is not None:
        raise _refuse(f"'json_schema.schema' is not a valid JSON Schema: {problem}")
    return StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False))


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes ``schema`` unusable: invalid under its metaschema (draft 2020-12 unless a known
    ``$schema`` says), or a ``$ref`` that is not local or does not resolve (nothing is fetched)."""
    from jsonschema import validators  # noqa: PLC0415 - only a structured request loads it
    from jsonschema.exceptions import SchemaError  # noqa: PLC0415

    known = {
        str(checker.META_SCHEMA.get("$id") or checker.META_SCHEMA["id"]).rstrip("#"): checker
        for checker in (
            validators.Draft4Validator,
            validators.Draft6Validator,
            validators.Draft7Validator,
            validators.Draft201909Validator,
            validators.Draft202012Validator,
        )
    }
    declared = schema.get("$schema", validators.Draft202012Validator.META_SCHEMA["$id"])
    if not isinstance(declared, str):
        return "'$schema' must be a string"
    checker = known.get(declared.rstrip("#"))
    if checker is None:
        return f"unknown '$schema' {declared!r} (known: {', '.join(sorted(known))})"
    try:
        checker.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        return f"{exc.message}" + (f" (at {where})" if where else "")
    except RecursionError:
        return "it is nested too deeply"
    return _ref_problem(schema)


def _ref_problem(root: dict[str, Any]) -> str | None:
    """The first ``$ref`` that is not a JSON pointer into this schema that resolves (walked without
    recursion: the metaschema check has bounded the depth already)."""
    pending: list[Any] = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and not _resolves(root, ref):
            return f"$ref {ref!r} is not a local reference (#/...) that resolves in the schema"
        pending.extend(node.values())
    return None


def _resolves(root: dict[str, Any], ref: str) -> bool:
    if not ref.startswith("#"):
        return False
    target: Any = root
    for step in [part.replace("~1", "/").replace("~0", "~") for part in ref[1:].split("/") if part]:
        if not isinstance(target, dict) or step not in target:
            return False
        target = target[step]
    return True


def _forced_schema(
    forced: ForcedTool, tools: Sequence[dict[str, Any]], parallel_tool_calls: bool | None
) -> dict[str, Any]:
    """vLLM's: the named function's parameters, or an array of calls of any tool (at least one)."""
    functions = dict(_functions(tools))
    if forced.name is not None:
        return functions.get(forced.name) or _EMPTY_OBJECT
    calls = [
        {
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _without_defs(params)},
            "required": ["name", "parameters"],
        }
        for name, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    defs = _shared_defs(functions)
    if defs:
        schema["$defs"] = defs
    return schema


def _functions(tools: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each function tool; a tool's invalid schema is a 400 (``tools``)."""
    found: list[tuple[str, dict[str, Any]]] = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        if params is None:
            params = _EMPTY_OBJECT
        if not isinstance(params, dict):
            raise StructuredOutputError(
                f"Invalid 'tools[{index}].function.parameters': a forced tool choice needs a JSON Schema "
                "object",
                param="tools",
            )
        problem = schema_problem(params)
        if problem is not None:
            raise StructuredOutputError(
                f"Invalid 'tools[{index}].function.parameters': not a valid JSON Schema: {problem}",
                param="tools",
            )
        found.append((function["name"], params or _EMPTY_OBJECT))
    return found


def _without_defs(params: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in params.items() if key != "$defs"} or _EMPTY_OBJECT


def _shared_defs(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every tool's ``$defs``, lifted to the array's root (where its ``#/$defs/...`` refs now point)."""
    shared: dict[str, Any] = {}
    for name, params in functions.items():
        defs = params.get("$defs") or {}
        if not isinstance(defs, dict):
            message = f"Invalid 'tools': $defs of {name!r} must be an object"
            raise StructuredOutputError(message, param="tools")
        for key, value in defs.items():
            if key in shared and shared[key] != value:
                raise StructuredOutputError(
                    f"Invalid 'tools': two tools define $defs {key!r} differently; a forced tool choice "
                    "needs one definition per name",
                    param="tools",
                )
            shared[key] = value
    return shared
