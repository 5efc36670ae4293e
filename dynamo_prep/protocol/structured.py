"""Structured outputs at the edge: a chat request's ``response_format`` and forced ``tool_choice`` as
the one ``StructuredOutput`` the engine constrains its decoding with (docs/structured-outputs.md).

A forced tool choice takes vLLM's OpenAI server's shapes: a named function's output is its
arguments object (its ``parameters`` schema); ``"required"`` is a JSON array of
``{"name", "parameters"}`` calls, one of the tools each. It wins over ``response_format``, as there.
Every schema is bounded first (``schema_bounds``), then checked against its metaschema: here, or
by the frontend in a process of its own (``request_schemas`` lists what to check).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from dynamo_prep.protocol.preprocessed import StructuredOutput
from dynamo_prep.protocol.schema_bounds import (
    SchemaBoundError,
    SchemaLimits,
    SchemaSize,
    measure,
    smallest_instance_chars,
)

__all__ = [
    "ACCEPTED_RESPONSE_FORMATS",
    "ForcedTool",
    "SchemaUse",
    "StructuredOutputError",
    "TokenBudget",
    "forced_tool",
    "request_schemas",
    "schema_problem",
    "structured_output",
]

ACCEPTED_RESPONSE_FORMATS: Final = (
    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
    '{"name": ..., "schema": {...}, "strict": true|false}}'
)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_OBJECT: Final = {"type": "object", "properties": {}}
DEFAULT_SCHEMA_LIMITS: Final = SchemaLimits()
# A metaschema problem as the client reads it: jsonschema's messages repr the offending value whole.
_SHOWN_PROBLEM_CHARS = 300


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


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """What an answer can spell: ``tokens`` (``source`` says which limit that is) of at most
    ``chars_per_token`` characters each (the vocabulary's longest token)."""

    tokens: int
    chars_per_token: int
    source: str = "max_tokens"

    @property
    def chars(self) -> int:
        return self.tokens * self.chars_per_token


@dataclass(frozen=True, slots=True)
class SchemaUse:
    """One schema of a request, bounded already: where it is (``where``, in ``param``)."""

    schema: dict[str, Any]
    param: str
    where: str
    name: str = ""  # a tool's

    def refusal(self, problem: str) -> StructuredOutputError:
        """The 400 for a metaschema ``problem`` of this schema."""
        if self.param == "response_format":
            return _refuse(f"{self.where} is not a valid JSON Schema: {problem}")
        return StructuredOutputError(
            f"Invalid {self.where}: not a valid JSON Schema: {problem}", param=self.param
        )


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
    budget: TokenBudget | None = None,
    limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS,
    metaschema: bool = True,
) -> StructuredOutput | None:
    """The constraint of a request (None: free text); raises ``StructuredOutputError``.

    Every schema is bounded by ``limits`` and, with a ``budget``, its smallest instance must fit
    it. ``metaschema=False``: the caller checked ``request_schemas`` against their metaschemas."""
    constraint, uses = _plan(
        response_format,
        tools,
        tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        budget=budget,
        limits=limits,
    )
    if metaschema:
        for use in uses:
            problem = schema_problem(use.schema)
            if problem is not None:
                raise use.refusal(problem)
    return constraint


def request_schemas(
    response_format: dict[str, Any] | str | None,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    *,
    parallel_tool_calls: bool | None = None,
    budget: TokenBudget | None = None,
    limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS,
) -> list[SchemaUse]:
    """The request's schemas that need a metaschema check, each bounded (``structured_output``'s
    refusals up to there are raised)."""
    return _plan(
        response_format,
        tools,
        tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        budget=budget,
        limits=limits,
    )[1]


def _plan(
    response_format: dict[str, Any] | str | None,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    *,
    parallel_tool_calls: bool | None,
    budget: TokenBudget | None,
    limits: SchemaLimits,
) -> tuple[StructuredOutput | None, list[SchemaUse]]:
    forced = forced_tool(tool_choice)
    if forced is not None and tools:
        uses = _functions(tools, limits)
        schema = _forced_schema(forced, uses, parallel_tool_calls)
        _check_budget(schema, budget, "tools", "the forced tool call")
        return StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False)), uses
    use = _from_response_format(response_format, limits)
    if not isinstance(use, SchemaUse):
        return use, []
    _check_budget(use.schema, budget, use.param, use.where)
    return StructuredOutput(json_schema=json.dumps(use.schema, ensure_ascii=False)), [use]


def _bounded(schema: dict[str, Any], limits: SchemaLimits, param: str, where: str) -> SchemaSize:
    """``measure``, its refusal as a 400 naming ``param`` and the limit."""
    try:
        return measure(schema, limits, what=where)
    except SchemaBoundError as exc:
        named = f" (--schema-limit {exc.limit})" if exc.limit else ""
        raise StructuredOutputError(f"Invalid '{param}': {exc}{named}", param=param) from None


def _check_budget(schema: dict[str, Any], budget: TokenBudget | None, param: str, what: str) -> None:
    """A schema whose shortest instance is longer than the answer can be is refused."""
    if budget is None:
        return
    smallest = smallest_instance_chars(schema)
    if smallest <= budget.chars:
        return
    raise StructuredOutputError(
        f"Invalid '{param}': the shortest JSON {what} allows is at least {smallest:,} characters; "
        f"{budget.source} ({budget.tokens:,} tokens of at most {budget.chars_per_token} characters) "
        "cannot hold it. Raise max_tokens, or lower the schema's minLength, minItems or minProperties.",
        param=param,
    )


def _refuse(detail: str) -> StructuredOutputError:
    message = f"Invalid 'response_format': {detail}. Accepted: {ACCEPTED_RESPONSE_FORMATS}."
    return StructuredOutputError(message, param="response_format")


def _from_response_format(
    response_format: dict[str, Any] | str | None, limits: SchemaLimits
) -> StructuredOutput | SchemaUse | None:
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
    _bounded(schema, limits, "response_format", "'json_schema.schema'")
    return SchemaUse(schema, "response_format", "'json_schema.schema'")


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
        return f"unknown '$schema' {declared[:100]!r} (known: {', '.join(sorted(known))})"
    try:
        checker.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part)[:40] for part in exc.absolute_path)[-200:]
        message = (
            exc.message
            if len(exc.message) <= _SHOWN_PROBLEM_CHARS
            else exc.message[:_SHOWN_PROBLEM_CHARS] + "..."
        )
        return message + (f" (at {where})" if where else "")
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
    forced: ForcedTool, uses: list[SchemaUse], parallel_tool_calls: bool | None
) -> dict[str, Any]:
    """vLLM's: the named function's parameters, or an array of calls of any tool (at least one)."""
    functions = {use.name: use.schema for use in uses}  # a repeated name: its last tool
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


def _functions(tools: Sequence[dict[str, Any]], limits: SchemaLimits) -> list[SchemaUse]:
    """Each function tool's parameters schema, bounded (a 400 naming ``tools``); together they are
    bounded like one schema, since ``"required"`` sends them as one."""
    found: list[SchemaUse] = []
    nodes = chars = 0
    for index, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        if params is None:
            params = _EMPTY_OBJECT
        where = f"'tools[{index}].function.parameters'"
        if not isinstance(params, dict):
            raise StructuredOutputError(
                f"Invalid {where}: a forced tool choice needs a JSON Schema object", param="tools"
            )
        size = _bounded(params, limits, "tools", where)
        nodes, chars = nodes + size.nodes, chars + size.chars
        if nodes > limits.max_nodes or chars > limits.max_chars:
            raise StructuredOutputError(
                f"Invalid 'tools': the forced tools' parameters together are more than {limits.max_nodes} "
                f"JSON values or {limits.max_chars} characters (--schema-limit max_nodes, max_chars)",
                param="tools",
            )
        found.append(SchemaUse(params or _EMPTY_OBJECT, "tools", where, function["name"]))
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
