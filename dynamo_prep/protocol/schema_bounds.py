"""The linear pre-pass every client JSON Schema goes through before anything else reads it: limits
on size, nesting and keyword counts, distinct ``type``/``required`` items, and the smallest instance
the schema allows against the request's token budget (docs/structured-outputs.md, "Bounds")."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Final

__all__ = [
    "SchemaBoundError",
    "SchemaLimits",
    "SchemaSize",
    "distinct",
    "measure",
    "smallest_instance_chars",
]


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """Every bound on a client's schema and on its metaschema check (``--schema-limit NAME=VALUE``)."""

    max_chars: int = 131_072  # characters of the schema's compact JSON text
    max_nodes: int = 8_192  # JSON values (objects, arrays, strings, numbers, booleans, nulls)
    max_depth: int = 48  # JSON nesting
    max_type_items: int = 7  # the seven type names
    max_enum_items: int = 1_024
    max_required: int = 1_024  # names in one "required"
    max_properties: int = 1_024  # entries in one "properties"
    check_timeout_s: float = 10.0  # one metaschema check
    check_processes: int = 2  # processes running metaschema checks
    check_queue: int = 32  # checks waiting for one of them; more are refused (503)

    @classmethod
    def with_overrides(cls, pairs: list[str]) -> SchemaLimits:
        """The defaults with ``NAME=VALUE`` pairs applied (a ValueError names a bad one)."""
        known = {field.name: field.type for field in fields(cls)}
        values: dict[str, Any] = {}
        for pair in pairs:
            name, _, text = pair.partition("=")
            name = name.strip().replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown schema limit {name!r} (known: {', '.join(known)})")
            value = float(text) if known[name] == "float" else int(text)
            if not value > 0:
                raise ValueError(f"schema limit {name} must be positive, got {text!r}")
            values[name] = value
        return cls(**values)


class SchemaBoundError(ValueError):
    """A schema past one of its bounds: ``limit`` names it (a ``SchemaLimits`` field; None: a list
    the metaschema refuses anyway, found here in linear time)."""

    def __init__(self, message: str, *, limit: str | None) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True, slots=True)
class SchemaSize:
    nodes: int
    chars: int


# What a schema keyword holds (every draft's keywords): one schema, a list of schemas, a map of names
# to schemas. Anything else (``const``, ``enum``, ``default``, ``examples``, unknown keywords) is a
# plain JSON value: counted, never read as a schema.
_ONE: Final = frozenset({
    "additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items",
    "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
})  # fmt: skip
_LIST: Final = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP: Final = frozenset({
    "$defs", "definitions", "dependencies", "dependentSchemas", "patternProperties", "properties",
})  # fmt: skip
# Lists the metaschemas want as distinct strings (checked here, so that jsonschema's uniqueItems on
# them is a sort, never its pairwise fallback, which is quadratic).
_NAME_MAPS: Final = frozenset({"dependentRequired", "dependencies"})
_SCHEMA, _SCHEMAS, _SCHEMA_MAP, _VALUE = range(4)
_DRAFT4: Final = "json-schema.org/draft-04/schema"
_SHOWN_KEY_CHARS = 40
_SHOWN_PATH_CHARS = 200


def measure(schema: Any, limits: SchemaLimits, *, what: str) -> SchemaSize:
    """Walk ``schema`` once, iteratively, stopping at the first bound it passes (a
    ``SchemaBoundError`` whose message starts with ``what``): at most ``limits.max_nodes`` steps."""
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    walk = _Walk(limits, what, draft4=isinstance(declared, str) and _DRAFT4 in declared)
    walk.run(schema)
    return SchemaSize(walk.nodes, walk.chars)


class _Walk:
    def __init__(self, limits: SchemaLimits, what: str, *, draft4: bool) -> None:
        self.limits = limits
        self.what = what
        self.draft4 = draft4
        self.nodes = 0
        self.chars = 0

    def run(self, root: Any) -> None:
        # (value, what it holds, depth, where: a (parent, key) chain, joined only for a message)
        pending: list[tuple[Any, int, int, Any]] = [(root, _SCHEMA, 1, None)]
        while pending:
            value, kind, depth, where = pending.pop()
            self._count(value, depth, where)
            if isinstance(value, dict):
                if kind == _SCHEMA:
                    self._check_keywords(value, where)
                for key, item in value.items():
                    pending.append((item, _inner(kind, key, item), depth + 1, (where, key)))
            elif isinstance(value, list):
                inner = _SCHEMA if kind == _SCHEMAS else _VALUE
                pending.extend((item, inner, depth + 1, (where, index)) for index, item in enumerate(value))

    def _count(self, value: Any, depth: int, where: Any) -> None:
        limits = self.limits
        self.nodes += 1
        if depth > limits.max_depth:
            self._refuse(f"is nested deeper than {limits.max_depth} levels", "max_depth", where)
        if isinstance(value, str):
            self.chars += len(value) + 3
        elif isinstance(value, dict | list):
            if self.nodes + len(value) > limits.max_nodes:
                self._refuse(f"has more than {limits.max_nodes} JSON values", "max_nodes", where)
            self.chars += 2 + (sum(len(key) + 4 for key in value) if isinstance(value, dict) else len(value))
        else:
            self.chars += 6
        if self.chars > limits.max_chars:
            self._refuse(f"is longer than {limits.max_chars} characters of JSON", "max_chars", where)

    def _check_keywords(self, schema: dict[str, Any], where: Any) -> None:
        limits = self.limits
        kind = schema.get("type")
        if isinstance(kind, list):
            self._names(kind, "type", limits.max_type_items, "max_type_items", (where, "type"))
        enum = schema.get("enum")
        if isinstance(enum, list):
            if len(enum) > limits.max_enum_items:
                detail = f"has an 'enum' of {len(enum)} values (the limit is {limits.max_enum_items})"
                self._refuse(detail, "max_enum_items", (where, "enum"))
            if self.draft4 and not distinct(enum):  # draft 4's metaschema wants them distinct
                self._refuse("has an 'enum' whose values are not distinct", None, (where, "enum"))
        required = schema.get("required")
        if isinstance(required, list):
            self._names(required, "required", limits.max_required, "max_required", (where, "required"))
        for key in _NAME_MAPS.intersection(schema):
            if isinstance(schema[key], dict):
                for name, names in schema[key].items():
                    if isinstance(names, list):
                        self._names(names, key, limits.max_required, "max_required", ((where, key), name))
        properties = schema.get("properties")
        if isinstance(properties, dict) and len(properties) > limits.max_properties:
            detail = (
                f"has {len(properties)} 'properties' in one object (the limit is {limits.max_properties})"
            )
            self._refuse(detail, "max_properties", (where, "properties"))

    def _names(self, names: list[Any], key: str, most: int, limit: str, where: Any) -> None:
        """A list the metaschema wants as distinct strings: counted, then checked in linear time."""
        if len(names) > most:
            self._refuse(f"has a '{key}' of {len(names)} items (the limit is {most})", limit, where)
        if not all(isinstance(name, str) for name in names):
            self._refuse(f"has a '{key}' list holding something other than strings", None, where)
        if len(set(names)) != len(names):
            self._refuse(f"has a '{key}' list whose items are not distinct", None, where)

    def _refuse(self, detail: str, limit: str | None, where: Any) -> None:
        path = _path(where)
        raise SchemaBoundError(f"{self.what} {detail}" + (f" (at {path})" if path else ""), limit=limit)


def _inner(kind: int, key: str, item: Any) -> int:
    """What a member holds: a schema's keyword by its name, a map of schemas' entries are schemas."""
    if kind == _SCHEMA_MAP:
        return _SCHEMA
    if kind != _SCHEMA:
        return _VALUE
    if key in _MAP and isinstance(item, dict):
        return _SCHEMA_MAP
    if key in _LIST and isinstance(item, list):
        return _SCHEMAS
    return _SCHEMA if key in _ONE else _VALUE


def _path(where: Any) -> str:
    """A JSON-pointer-like path to a node (each key cut to 40 characters, the whole to 200)."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(str(key)[:_SHOWN_KEY_CHARS])
    text = "/".join(reversed(parts))
    return text if len(text) <= _SHOWN_PATH_CHARS else "..." + text[-_SHOWN_PATH_CHARS:]


# -- uniqueness in linear time ------------------------------------------------------------------------


def distinct(values: list[Any]) -> bool:
    """Whether ``values`` are pairwise different as JSON values (``1`` equals ``1.0``, ``true`` is not
    ``1``, objects compare by their members): each value's canonical form is hashed once."""
    seen: set[Any] = set()
    for value in values:
        key = _canonical(value)
        if key in seen:
            return False
        seen.add(key)
    return True


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)  # 1 == 1.0 and they hash alike
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("l", tuple(_canonical(item) for item in value))
    if isinstance(value, dict):
        return ("d", frozenset((key, _canonical(item)) for key, item in value.items()))
    return ("?", repr(value))


# -- the smallest instance ----------------------------------------------------------------------------

_CAP: Final = 1 << 62
_MOST_NESTED: Final = 200  # deeper (references followed) counts as 0: still a lower bound
_ALL_TYPES: Final = frozenset({"string", "integer", "number", "boolean", "null", "array", "object"})


def smallest_instance_chars(root: Any) -> int:
    """A lower bound on the characters of the shortest JSON text valid under ``root``: each
    subschema is sized once (references included), so the cost is linear in the schema."""
    return _Smallest(root).size(root, 0)


class _Smallest:
    """Sizes subschemas once each, per set of types their context allows (a branch of an ``anyOf``
    under ``"type": "object"`` sizes as an object)."""

    def __init__(self, root: Any) -> None:
        self._root = root
        self._sizes: dict[tuple[int, frozenset[str]], int] = {}

    def size(self, schema: Any, depth: int, kinds: frozenset[str] = _ALL_TYPES) -> int:
        if not isinstance(schema, dict):
            return 1 if schema is not False else 0
        key = (id(schema), kinds)
        known = self._sizes.get(key)
        if known is not None:
            return known
        if depth > _MOST_NESTED:
            return 0
        self._sizes[key] = 0  # while being sized: a reference cycle counts 0
        found = min(self._bound(schema, depth, kinds), _CAP)
        self._sizes[key] = found
        return found

    def _bound(self, schema: dict[str, Any], depth: int, kinds: frozenset[str]) -> int:
        own = _kinds(schema.get("type"), kinds)
        bounds = [min((self._of_type(schema, kind, depth) for kind in own), default=0)]
        if "const" in schema:
            bounds.append(_value_chars(schema["const"]))
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            bounds.append(min(_value_chars(value) for value in enum))
        ref = schema.get("$ref")
        if isinstance(ref, str):
            bounds.append(self.size(self._target(ref), depth + 1, own))
        for part in _schemas(schema.get("allOf")):
            bounds.append(self.size(part, depth + 1, own))
        for key in ("anyOf", "oneOf"):
            branches = [
                self.size(branch, depth + 1, own)
                for branch in _schemas(schema.get(key))
                if branch is not False
            ]
            if branches:
                bounds.append(min(branches))
        return max(bounds)

    def _target(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return True
        target: Any = self._root
        for step in (part.replace("~1", "/").replace("~0", "~") for part in ref[1:].split("/") if part):
            target = target.get(step) if isinstance(target, dict) else None
            if target is None:
                return True
        return target

    def _of_type(self, schema: dict[str, Any], kind: str, depth: int) -> int:
        if kind == "string":
            return 2 + _count(schema, "minLength")
        if kind in ("boolean", "null"):
            return 4
        if kind == "array":
            return self._array(schema, depth)
        if kind == "object":
            return self._object(schema, depth)
        return 1

    def _array(self, schema: dict[str, Any], depth: int) -> int:
        wanted = _count(schema, "minItems")
        if not wanted:
            return 2
        prefix, items = schema.get("prefixItems"), schema.get("items")
        if not isinstance(prefix, list):  # before 2020-12: a list of "items", then "additionalItems"
            prefix, items = (items, schema.get("additionalItems")) if isinstance(items, list) else ([], items)
        head = [max(self.size(sub, depth + 1), 1) for sub in prefix[:wanted]]
        rest = (wanted - len(head)) * max(self.size(items, depth + 1) if items is not None else 1, 1)
        return 2 + sum(head) + rest + wanted - 1

    def _object(self, schema: dict[str, Any], depth: int) -> int:
        found = schema.get("properties")
        properties: dict[str, Any] = found if isinstance(found, dict) else {}
        required = schema.get("required")
        names = {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()
        members = [len(name) + 3 + max(self.size(properties.get(name, True), depth + 1), 1) for name in names]
        extra = max(_count(schema, "minProperties") - len(names), 0)
        count = len(members) + extra
        return 2 + sum(members) + 4 * extra + max(count - 1, 0)


def _kinds(kind: Any, allowed: frozenset[str]) -> frozenset[str]:
    """The types a schema's ``type`` allows among those its context allows ("integer" is a number)."""
    named = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if named is None:
        return allowed
    if "number" in named:
        named.add("integer")
    return allowed.intersection(named)


def _schemas(value: Any) -> Iterator[Any]:
    if isinstance(value, list):
        yield from value


def _count(schema: dict[str, Any], key: str) -> int:
    value = schema.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return int(min(max(value, 0), _CAP))


def _value_chars(value: Any) -> int:
    """The characters of ``value``'s shortest JSON text, at least (numbers count 1)."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, bool):
        return 4
    if value is None:
        return 4
    if isinstance(value, list):
        return 2 + sum(_value_chars(item) for item in value) + max(len(value) - 1, 0)
    if isinstance(value, dict):
        members = sum(len(key) + 3 + _value_chars(item) for key, item in value.items())
        return 2 + members + max(len(value) - 1, 0)
    return 1
