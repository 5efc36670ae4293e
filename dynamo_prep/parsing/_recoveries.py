"""The kinds of recovery from malformed model output, and a per-response counter of them.

A kind is a stable label of ``dynamo_frontend_output_parse_errors_total{model,kind}``; every kind
is listed in ``RECOVERY_KINDS`` (and documented in docs/answers.md), so the frontend can
pre-register the series. A max_tokens cut (``finish("length")``) is truncation, not malformed
output: what the cut leaves unfinished is dropped or released without being counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

MISSING_THINK_CLOSE: Final = "missing_think_close"
"""Reasoning ended by something other than its close tag (another channel, a call, the end)."""
MISSING_SEP: Final = "missing_sep"
"""A K3 tag header ended without its ``<|sep|>`` (another marker came, or it grew too long)."""
UNKNOWN_TAG: Final = "unknown_tag"
"""A tag that is unknown, or not valid where it appears; it is dropped, its text flows on."""
GARBAGE: Final = "garbage"
"""Non-whitespace text where none belongs (between calls, after the message), or a stray ``<|sep|>``."""
TEXT_OUTSIDE_CHANNEL: Final = "text_outside_channel"
"""K3 text written outside any channel; it is returned as content."""
UNCLOSED_CHANNEL: Final = "unclosed_channel"
"""A channel, element or the message frame closed implicitly (by an enclosing close, an opener, the end)."""
MISSING_TOOLS_OPEN: Final = "missing_tools_open"
"""A K3 call opened outside a ``tools`` channel; the channel is opened for it."""
UNCLOSED_CALL: Final = "unclosed_call"
"""A call without its close tag, recovered because its last element was complete."""
DROPPED_CALL: Final = "dropped_call"
"""A call without its close tag, dropped because the model ended inside it (mid-value)."""
CALL_WITHOUT_TOOL: Final = "call_without_tool"
"""A K3 call without a ``tool`` attribute, dropped."""
ARGUMENT_WITHOUT_KEY: Final = "argument_without_key"
"""A K3 argument without a ``key`` attribute, dropped."""
DUPLICATE_ARGUMENT: Final = "duplicate_argument"
"""A K3 argument key written twice; the later value wins (as ``json.loads`` would have it)."""
EXTRA_CALL_ELEMENT: Final = "extra_call_element"
"""A K3 element beside a ``json`` block (a json block must be the call's only element), dropped."""
INVALID_JSON_BLOCK: Final = "invalid_json_block"
"""A K3 ``json`` block that is not a JSON object; it still passes through byte for byte."""
INVALID_ARGUMENT_VALUE: Final = "invalid_argument_value"
"""A typed K3 argument value that is not JSON; it is kept as a string."""
INVALID_TOOL_CALL: Final = "invalid_tool_call"
"""A Hermes call whose JSON does not parse or has no ``name``; it stays content."""
FOREIGN_MESSAGE: Final = "foreign_message"
"""A Harmony message of another role, or to a built-in tool on the commentary channel, dropped."""
UNTERMINATED_HEADER: Final = "unterminated_header"
"""A Harmony header not ended by ``<|message|>``: dropped (its text is content when it ran long)."""
MISSING_START: Final = "missing_start"
"""A Harmony header that begins without ``<|start|>`` (a ``<|channel|>`` between messages); read."""
TOOL_CALL_NOT_ALLOWED: Final = "tool_call_not_allowed"
"""A call made while tools are disabled (``tool_choice: "none"``), dropped."""
SPECIAL_TOKEN: Final = "special_token"
"""A special id that is neither a marker nor a stop id, dropped (it never becomes text)."""
INVALID_TOKEN: Final = "invalid_token"
"""A token id outside the vocabulary, dropped."""

RECOVERY_KINDS: Final = (
    MISSING_THINK_CLOSE,
    MISSING_SEP,
    UNKNOWN_TAG,
    GARBAGE,
    TEXT_OUTSIDE_CHANNEL,
    UNCLOSED_CHANNEL,
    MISSING_TOOLS_OPEN,
    UNCLOSED_CALL,
    DROPPED_CALL,
    CALL_WITHOUT_TOOL,
    ARGUMENT_WITHOUT_KEY,
    DUPLICATE_ARGUMENT,
    EXTRA_CALL_ELEMENT,
    INVALID_JSON_BLOCK,
    INVALID_ARGUMENT_VALUE,
    INVALID_TOOL_CALL,
    FOREIGN_MESSAGE,
    UNTERMINATED_HEADER,
    MISSING_START,
    TOOL_CALL_NOT_ALLOWED,
    SPECIAL_TOKEN,
    INVALID_TOKEN,
)


class Recoveries:
    """Counts of recovery kinds for one response; ``muted`` while a max_tokens cut is unwound."""

    __slots__ = ("_counts", "muted", "view")

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self.view: Mapping[str, int] = MappingProxyType(self._counts)
        self.muted = False

    def add(self, kind: str) -> None:
        if not self.muted:
            self._counts[kind] = self._counts.get(kind, 0) + 1
