"""JSON the way tool-call arguments need it: strict, and compacted without re-spelling anything.

Arguments keep the model's own spelling of every value (``1.0`` stays ``1.0``, ``1e2`` stays
``1e2``, string escapes stay as written): the JSON text is compacted lexically, by removing the
whitespace outside strings, never parsed and re-serialized.
"""

from __future__ import annotations

import json
import re
from typing import Any

_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_BLANKS = re.compile(rf"({_STRING})|[ \t\n\r]+", re.DOTALL)
_TOKENS = re.compile(rf'{_STRING}|[{{}}\[\],:]|[^"{{}}\[\],:]+', re.DOTALL)


class JsonError(ValueError):
    """Text that is not strict JSON (NaN and Infinity included: OpenAI arguments must be JSON)."""


def _reject_constant(name: str) -> Any:
    raise JsonError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """``json.loads`` without NaN/Infinity, and never a RecursionError or an int-size error."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise JsonError(str(exc)) from exc


def is_object(text: str) -> bool:
    try:
        return isinstance(loads(text), dict)
    except JsonError:
        return False


def compact(text: str) -> str:
    """Valid JSON text without insignificant whitespace; strings are kept byte for byte."""
    return _BLANKS.sub(lambda match: match.group(1) or "", text)


def dumps_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def members(compact_object: str) -> list[tuple[str, str]]:
    """(key, value text) of each top-level member of a compact, valid JSON object, in order."""
    found: list[tuple[str, str]] = []
    depth = 0
    key: str | None = None
    start = 0
    for match in _TOKENS.finditer(compact_object):
        token = match.group()
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            if depth == 1:
                if key is not None:
                    found.append((key, compact_object[start : match.start()]))
                break
            depth -= 1
        elif depth == 1:
            if token == ",":
                if key is not None:
                    found.append((key, compact_object[start : match.start()]))
                key = None
            elif token == ":":
                start = match.end()
            elif key is None:
                key = json.loads(token)
    return found


def elements(compact_array: str) -> list[str]:
    """The text of each top-level element of a compact, valid JSON array, in order."""
    found: list[str] = []
    depth = 0
    start = 1
    for match in _TOKENS.finditer(compact_array):
        token = match.group()
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
            if depth == 0:
                if match.start() > start:
                    found.append(compact_array[start : match.start()])
                break
        elif token == "," and depth == 1:
            found.append(compact_array[start : match.start()])
            start = match.end()
    return found
