"""Hermes tool calls (Qwen2.5/Qwen3, ``hermes``): ``<tool_call>{json}</tool_call>`` blocks.

Real Qwen2.5/Qwen3 vocabularies register the tags as (non-special) added tokens; a tag that is a
token is matched on its id, so text can never fake it. A tag that is no token (as in the
qwen-vl-demo vocabulary) is matched in the decoded text, and a streamed tail that could still grow
into one is held back until the next text decides. Grammar and recoveries: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import CallIds, DeltaList, new_call_id
from dynamo_prep.parsing._calls import json_call
from dynamo_prep.parsing._compose import ComposedAnswerParser
from dynamo_prep.parsing._halves import BetweenCalls, ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._tokens import Vocab
from dynamo_prep.parsing.think import THINK_CLOSE, THINK_OPEN, ThinkTagReasoning, prompt_ends_in_think

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "THINK_CLOSE",
    "THINK_OPEN",
    "HermesAnswerParser",
    "HermesTools",
    "parse_call",
    "prompt_ends_in_think",
]

CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"


class HermesTools(ToolHalf):
    """Content, and a call per ``<tool_call>`` block. Text between and after calls is content, except
    whitespace alone (the newlines between calls)."""

    MARKERS = (CALL_OPEN, CALL_CLOSE)
    OPENERS = (CALL_OPEN,)

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._body: list[str] | None = None  # inside a call: its body so far
        self._between = BetweenCalls()

    def _looking_for(self) -> tuple[str, ...]:
        return self.MARKERS[1:] if self._body is not None else self.OPENERS

    def _on_text(self, text: str, out: DeltaList) -> None:
        if self._body is not None:
            self._body.append(text)
        else:
            self._between.content(text, out)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._between.drop_held()  # whitespace after a call, then a tag: dropped
        if marker == CALL_OPEN:
            if self._body is not None:
                self._end_call(out, closed=False)
            self._body, self._between.after_call = [], False
        elif marker == CALL_CLOSE and self._body is not None:
            self._end_call(out, closed=True)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._between.drop_held()
        if self._body is not None:
            if cut:  # a call cut by max_tokens is never half sent
                self._body = None
            else:
                self._end_call(out, closed=False)

    def _end_call(self, out: DeltaList, *, closed: bool) -> None:
        body, self._body = "".join(self._body or ()), None
        self._between.after_call = True
        parsed = parse_call(body)
        if parsed is None:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            out.content(CALL_OPEN + body + (CALL_CLOSE if closed else ""))
            return
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        self._call(*parsed, out)


class HermesAnswerParser(ComposedAnswerParser):
    """Think tags (``think_tags``) and Hermes calls (``tool_calls``) on ``vocab``'s ids, composed as
    the registry composes ``qwen3`` + ``hermes`` (``start_in_reasoning``: the prompt opened the block)."""

    def __init__(
        self,
        vocab: Vocab,
        *,
        think_tags: bool,
        start_in_reasoning: bool,
        tool_calls: bool,
        tools_enabled: bool = True,
        call_ids: CallIds | None = None,
    ) -> None:
        options = ParseOptions(
            thinking=start_in_reasoning, tools_enabled=tools_enabled, call_ids=call_ids or new_call_id
        )
        reasoning = ThinkTagReasoning if think_tags else None
        tools = HermesTools if tool_calls else None
        family = "+".join(name for name, on in (("qwen3", think_tags), ("hermes", tool_calls)) if on)
        super().__init__(vocab, reasoning, tools, options, family=family or "plain")


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a Hermes call body ``{"name": ..., "arguments": {...}}``, or None
    (``json_call``: ``arguments`` or ``parameters``, the model's spelling kept; missing means ``{}``)."""
    return json_call(body, arguments_required=False)
