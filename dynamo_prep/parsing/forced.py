"""Answers under a forced tool choice: the engine constrained the output to JSON (vLLM's shapes,
``dynamo_prep.protocol.structured``), which this parser turns into the calls.

The model's own parser still runs first (reasoning is read as usual); its content is the JSON,
held until the end: a named function's arguments object becomes one call of that function,
``"required"``'s array of ``{"name", "parameters"}`` one call each. Output that is not that JSON
(cut by ``max_tokens``, or an engine that did not constrain) is released as content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dynamo_prep.parsing._answer import (
    AnswerDelta,
    AnswerParser,
    CallIds,
    ContentDelta,
    ToolCallDelta,
    new_call_id,
)
from dynamo_prep.parsing._json import JsonError, loads
from dynamo_prep.protocol.structured import ForcedTool

__all__ = ["ForcedToolParser"]


class ForcedToolParser:
    """Wraps a model's parser: content is held and read as the forced call(s) at ``finish``."""

    def __init__(self, inner: AnswerParser, forced: ForcedTool, *, call_ids: CallIds | None = None) -> None:
        self._inner = inner
        self._forced = forced
        self._call_ids = call_ids or new_call_id
        self._held: list[str] = []
        self._calls = 0

    @property
    def recoveries(self) -> Mapping[str, int]:
        return self._inner.recoveries

    @property
    def reasoning_tokens(self) -> int:
        return self._inner.reasoning_tokens

    @property
    def family(self) -> str:
        return self._inner.family

    def feed(self, token_ids: Sequence[int]) -> list[AnswerDelta]:
        return self._hold(self._inner.feed(token_ids))

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        deltas = self._hold(self._inner.finish(finish_reason))
        text = "".join(self._held).strip()
        self._held.clear()
        if not text:
            return deltas
        calls = self._read(text)
        deltas.extend(calls if calls is not None else [ContentDelta(text)])
        return deltas

    def _hold(self, deltas: list[AnswerDelta]) -> list[AnswerDelta]:
        kept: list[AnswerDelta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                self._held.append(delta.text)
            else:
                if isinstance(delta, ToolCallDelta):
                    self._calls += 1
                kept.append(delta)
        return kept

    def _read(self, text: str) -> list[AnswerDelta] | None:
        """The calls ``text`` holds, or None when it is not the forced shape."""
        try:
            value = loads(text)
        except JsonError:
            return None
        if self._forced.name is not None:
            return [self._call(self._forced.name, value)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not value or not all(_is_call(item) for item in value):
            return None
        return [self._call(item["name"], item["parameters"]) for item in value]

    def _call(self, name: str, arguments: dict[str, Any]) -> ToolCallDelta:
        index = self._calls
        self._calls += 1
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        return ToolCallDelta(index=index, id=self._call_ids(), name=name, arguments=text)


def _is_call(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and isinstance(item.get("parameters"), dict)
    )
