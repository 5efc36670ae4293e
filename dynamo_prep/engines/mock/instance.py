"""The mock's constrained decoding: a small, deterministic instance of a JSON schema.

What a real engine's grammar guarantees (the output validates), without a model: ``const``, then
``enum``'s first value, then the first branch (not ``false``) of ``anyOf``/``oneOf``, ``allOf`` merged, local
``$ref``s followed; objects get their required properties, arrays ``minItems`` items, strings
``"mock"`` fitted to ``minLength``/``maxLength``, numbers the smallest allowed value near 1.
``pattern`` and ``format`` are not generated for (the mock's string may not match them).
With ``max_chars`` the instance stops growing there (an answer cut at ``max_tokens`` needs no
more): building costs at most linear time in it, whatever counts the schema asks for.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

__all__ = ["instance_of"]

MOCK_STRING: Final = "mock"
_MAX_DEPTH: Final = 32
_TYPE_ORDER: Final = ("object", "array", "string", "integer", "number", "boolean", "null")


def instance_of(schema: Any, *, max_chars: int | None = None) -> Any:
    """An instance of ``schema`` (a JSON Schema object or boolean) built from its root; with
    ``max_chars``, about that many characters of its JSON text at most (then it is cut short)."""
    root = schema if isinstance(schema, dict) else {}
    return _Builder(root, _UNBOUNDED if max_chars is None else max_chars).build(schema, 0)


_UNBOUNDED: Final = 1 << 62


class _Builder:
    def __init__(self, root: dict[str, Any], max_chars: int) -> None:
        self._root = root
        self._left = max_chars  # characters of JSON text (", " and ": " separators) still to take
        self._sizes: dict[int, int] = {}  # the JSON length of const and enum values, by identity

    @property
    def spent(self) -> bool:
        return self._left <= 0

    def _charge(self, chars: int) -> None:
        self._left -= chars

    def build(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            self._charge(4)
            return None if depth > _MAX_DEPTH else {}
        schema = self._resolved(schema)
        if "const" in schema:
            return self._given(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._given(enum[0])
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                merged = {k: v for k, v in schema.items() if k != key}
                branch = next((b for b in branches if b is not False), branches[0])
                return self.build(_merge(merged, self._resolved(branch)), depth + 1)
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged = _merge(merged, self._resolved(part))
            return self.build(merged, depth + 1)
        return self._typed(schema, _type_of(schema), depth)

    def _given(self, value: Any) -> Any:
        """A value the schema spells out, charged at its JSON length (measured once per value)."""
        size = self._sizes.get(id(value))
        if size is None:
            size = self._sizes[id(value)] = len(json.dumps(value, ensure_ascii=False))
        self._charge(size)
        return value

    def _resolved(self, schema: Any) -> dict[str, Any]:
        """A local ``$ref`` (``#/$defs/...``, ``#/definitions/...``, ``#``) followed, siblings kept.

        A boolean schema (``true``/``false``) or any non-object resolves to ``{}``: no constraint.
        """
        if not isinstance(schema, dict):
            return {}
        resolved: dict[str, Any] = schema
        seen = 0
        while isinstance(ref := resolved.get("$ref"), str) and ref.startswith("#") and seen < _MAX_DEPTH:
            target: Any = self._root
            for step in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]:
                target = target.get(step) if isinstance(target, dict) else None
            rest = {k: v for k, v in resolved.items() if k != "$ref"}
            resolved = _merge(target if isinstance(target, dict) else {}, rest)
            seen += 1
        return resolved

    def _typed(self, schema: dict[str, Any], kind: str, depth: int) -> Any:
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "string":
            text = _string(schema, max(self._left, 0))
            self._charge(len(text) + 2)
            return text
        self._charge(5)
        if kind in ("integer", "number"):
            return _number(schema, integer=kind == "integer")
        if kind == "boolean":
            return True
        return None

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        found = schema.get("properties")
        properties: dict[str, Any] = found if isinstance(found, dict) else {}
        listed = schema.get("required")
        required = [name for name in listed if isinstance(name, str)] if isinstance(listed, list) else []
        self._charge(2)
        result: dict[str, Any] = {}
        for name in required:
            if self.spent:
                return result
            self._charge(_key_chars(name))
            result[name] = self.build(properties.get(name, {}), depth + 1)
        minimum = schema.get("minProperties")
        for name, sub in properties.items():
            if not isinstance(minimum, int) or len(result) >= minimum or self.spent:
                break
            if name not in result:
                self._charge(_key_chars(name))
                result[name] = self.build(sub, depth + 1)
        return result

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        found = schema.get("prefixItems")
        prefix: list[Any] = found if isinstance(found, list) else []
        count = max(int(_finite(schema.get("minItems"))), 0)
        self._charge(2)
        items: list[Any] = []
        for sub in prefix[:count]:
            if self.spent:
                return items
            items.append(self.build(sub, depth + 1))
        element = schema.get("items", {})
        while len(items) < count and not self.spent:
            self._charge(2)
            items.append(self.build(element, depth + 1))
        if schema.get("uniqueItems") and len(items) > 1:
            down = isinstance(element, dict) and ("maximum" in element or "exclusiveMaximum" in element)
            items = [_distinct(item, -index if down else index) for index, item in enumerate(items)]
        return items


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [item for item in kind if isinstance(item, str)]
        kind = next((item for item in _TYPE_ORDER if item in kinds and item != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "object"


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if key == "properties" and isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        elif key == "required" and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = list(dict.fromkeys([*merged[key], *value]))  # linear, order kept
        else:
            merged[key] = value
    return merged


def _key_chars(name: str) -> int:
    """A member's name as it is written (``"name": ``, escapes included) and its separator."""
    return len(json.dumps(name, ensure_ascii=False)) + 4


def _finite(value: Any) -> float:
    """A count keyword's value as a number (0 when it is not a finite one)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return value


def _string(schema: dict[str, Any], most: int) -> str:
    """ "mock" fitted to the length bounds, at most ``most`` characters (then cut short)."""
    low = min(max(int(_finite(schema.get("minLength"))), 0), most)
    high = schema.get("maxLength")
    text = MOCK_STRING * (low // len(MOCK_STRING) + 1)
    text = text[: max(low, len(MOCK_STRING))]
    return text[:high] if isinstance(high, int) and high >= 0 else text


def _number(schema: dict[str, Any], *, integer: bool) -> int | float:
    """1 when the bounds allow it, else a value inside them (then rounded up to ``multipleOf``)."""
    low, low_open = _bound(schema, "minimum", "exclusiveMinimum", max)
    high, high_open = _bound(schema, "maximum", "exclusiveMaximum", min)
    value: float = 1
    if integer:
        low = None if low is None else (math.floor(low) + 1 if low_open else math.ceil(low))
        high = None if high is None else (math.ceil(high) - 1 if high_open else math.floor(high))
        value = max(value, low) if low is not None else value
        value = min(value, high) if high is not None else value
    else:
        if low is not None and (value < low or (value == low and low_open)):
            value = low if not low_open else low + 1 if high is None else (low + high) / 2
        if high is not None and (value > high or (value == high and high_open)):
            value = high if not high_open else high - 1 if low is None else (low + high) / 2
    step = schema.get("multipleOf")
    if isinstance(step, int | float) and not isinstance(step, bool) and step > 0:
        value = math.ceil(value / step) * step
    return math.ceil(value) if integer else value


def _bound(schema: dict[str, Any], closed: str, opened: str, pick: Any) -> tuple[float | None, bool]:
    """The tighter of a closed and an open bound, and whether it is open."""
    found = [
        (value, key == opened)
        for key in (closed, opened)
        if isinstance(value := schema.get(key), int | float) and not isinstance(value, bool)
    ]
    if not found:
        return None, False
    value = pick(bound for bound, _ in found)
    return value, any(bound == value and is_open for bound, is_open in found)


def _distinct(item: Any, index: int) -> Any:
    """Items made distinct for ``uniqueItems``: strings and numbers by their index (away from a maximum)."""
    if isinstance(item, str) and index:
        suffix = str(abs(index))  # in place of the last characters: the length stays in bounds
        return item[: max(len(item) - len(suffix), 0)] + suffix
    if isinstance(item, int | float) and not isinstance(item, bool):
        return item + index
    return item
