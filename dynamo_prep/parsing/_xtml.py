"""K3 XTML tag headers: the text between ``<|open|>``/``<|close|>`` and ``<|sep|>``.

A header is a tag name and ``key="value"`` attributes, all plain text (only the four markers are
special ids). Values unescape ``&quot;`` then ``&amp;``, the inverse of the renderer's escaping.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

MESSAGE: Final = "message"
THINK: Final = "think"
RESPONSE: Final = "response"
TOOLS: Final = "tools"
CALL: Final = "call"
ARGUMENT: Final = "argument"
JSON: Final = "json"

PARENT: Final = {THINK: MESSAGE, RESPONSE: MESSAGE, TOOLS: MESSAGE, CALL: TOOLS, ARGUMENT: CALL, JSON: CALL}
"""Each element and the element it belongs in."""
KNOWN: Final = (*PARENT, MESSAGE)
_BY_LENGTH: Final = tuple(sorted(KNOWN, key=len, reverse=True))

_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)")
_ATTR = re.compile(r'\s*([^\s="]+)="([^"]*)"')
_ATTRS = re.compile(r'(?:\s*[^\s="]+="[^"]*")*')


class Header(NamedTuple):
    name: str | None
    attrs: dict[str, str]
    rest: str
    """Text after the tag in a header that never got its ``<|sep|>``; it flows on as text."""


def unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    for key, value in _ATTR.findall(text):
        attrs.setdefault(key, unescape(value))
    return attrs


def parse(text: str) -> Header:
    """A header closed by ``<|sep|>``: its name and attributes (anything unparseable is ignored)."""
    match = _NAME.match(text)
    if match is None:
        return Header(None, {}, "")
    return Header(match.group(1), _attrs(text[match.end() :]), "")


def parse_unterminated(text: str) -> Header:
    """A header cut short by another marker: a known tag name at its start, the attributes that
    follow it, and the rest as text. Without a known name, the whole header is text."""
    stripped = text.lstrip()
    for name in _BY_LENGTH:
        if stripped.startswith(name):
            after = stripped[len(name) :]
            attrs = _ATTRS.match(after)
            end = attrs.end() if attrs is not None else 0
            return Header(name, _attrs(after[:end]), after[end:])
    return Header(None, {}, text)
