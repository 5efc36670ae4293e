"""Qwen/Hermes answers: ``<think>...</think>`` reasoning and ``<tool_call>{json}</tool_call>`` calls.

Real Qwen2.5/Qwen3 vocabularies register the tags as (non-special) added tokens; a tag that is a
token is matched on its id, so text can never fake it. A tag that is no token (as in the
qwen-vl-demo vocabulary) is matched in the decoded text, and a streamed tail that could still grow
into one is held back until the next text decides. Grammar and recoveries: docs/answers.md.
"""

from __future__ import annotations

from typing import Final

from dynamo_prep.parsing import _json
from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import AnswerDelta, CallIds, DeltaList, ToolCallDelta, new_call_id
from dynamo_prep.parsing._stream import IdStreamParser
from dynamo_prep.parsing._tokens import Vocab

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "THINK_CLOSE",
    "THINK_OPEN",
    "HermesAnswerParser",
    "prompt_ends_in_think",
]

THINK_OPEN: Final = "<think>"
THINK_CLOSE: Final = "</think>"
CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"

_REASONING, _CONTENT, _CALL = range(3)


class HermesAnswerParser(IdStreamParser[str]):
    """One response. ``think_tags`` / ``tool_calls`` switch each half of the grammar on;
    ``start_in_reasoning`` says the prompt opened the think block (text before ``</think>`` is
    reasoning). A ``<think>`` is honoured only at the very start (after whitespace at most)."""

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
        tags: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE) if think_tags else ()
        tags += (CALL_OPEN, CALL_CLOSE) if tool_calls else ()
        specials = vocab.special_tokens
        super().__init__(vocab, {specials[tag]: tag for tag in tags if tag in specials})
        self._text_tags = frozenset(tag for tag in tags if tag not in specials)
        self._tools_enabled = tools_enabled
        self._call_ids = call_ids or new_call_id
        self._state = _REASONING if think_tags and start_in_reasoning else _CONTENT
        self._start = think_tags  # nothing but whitespace yet: a <think> may still open the answer
        self._pending = ""  # decoded text not yet released (a partial tag, whitespace just in)
        self._held = bytearray()  # whitespace before _pending (UTF-8), held at the start or after a call
        self._body: list[str] = []
        self._after_call = False  # a call just ended: whitespace alone is not content
        self._calls = 0

    def finish(self, finish_reason: str) -> list[AnswerDelta]:
        out = DeltaList()
        cut = finish_reason == "length"
        self._pending += self._utf8.flush(cut=cut)
        if cut:  # held text may be the start of a tag the cut interrupted: it is not released
            self._pending = ""
            self._drop_held()
            self._body = []
        elif self._state == _CALL:
            self._body.append(self._pending)
            self._pending = ""
            self._end_call(out, closed=False)
        else:
            self._scan(out, final=True)
            if self._state == _REASONING:
                self._recoveries.add(kinds.MISSING_THINK_CLOSE)
        self._state = _CONTENT
        return out.done()

    # ------------------------------------------------------------------ text

    def _in_reasoning(self) -> bool:
        return self._state == _REASONING

    def _on_text(self, token_ids: list[int], out: DeltaList) -> None:
        self._pending += self._utf8.push(self._vocab.bytes_of(token_ids))
        self._scan(out, final=False)

    def _on_tag(self, tag: str, out: DeltaList) -> None:
        self._pending += self._utf8.flush()
        if tag == THINK_OPEN and self._start:
            self._pending = ""  # whitespace before the opening tag
            self._drop_held()
        else:
            self._scan(out, final=True)
        self._tag(tag, out)

    def _scan(self, out: DeltaList, *, final: bool) -> None:
        """Releases pending text up to each text tag it holds, holding back what may still become one.

        After a call, text that is only whitespace (the newlines between calls) is held and dropped
        unless more text follows it. Held whitespace is set aside (``_held``) and pending text is
        read from a cursor, so every character is scanned a bounded number of times.
        """
        if self._start and not self._starts(final):
            return
        pending, at = self._pending, 0
        while True:
            found = self._next_tag(pending, at)
            end = (
                found[0]
                if found is not None
                else len(pending) - (0 if final else self._partial_tag(pending, at))
            )
            released = pending[at:end]
            if self._after_call:
                if released.strip():
                    self._after_call = False
                    released = self._unhold() + released
                elif found is None and not final:
                    self._held += released.encode()
                    self._pending = pending[end:]
                    return
                else:
                    self._drop_held()
                    released = ""
            self._release(released, out)
            if found is None:
                self._pending = pending[end:]
                return
            at = end + len(found[1])
            self._tag(found[1], out)

    def _starts(self, final: bool) -> bool:
        """At the start: False to keep holding; True once the answer has begun (``<think>`` or text)."""
        pending = self._pending
        stripped = pending.lstrip()
        if THINK_OPEN in self._text_tags and self._state != _CALL:
            if stripped.startswith(THINK_OPEN):
                self._pending = stripped[len(THINK_OPEN) :]
                self._drop_held()
                self._start = False
                self._state = _REASONING
                return True
            if not final and THINK_OPEN.startswith(stripped):
                self._hold_blank(pending, stripped)
                return False
        elif not final and not stripped:
            self._hold_blank(pending, stripped)
            return False
        self._start = False
        self._pending = self._unhold() + pending
        return True

    def _hold_blank(self, pending: str, stripped: str) -> None:
        """Sets the whitespace in front of ``pending`` aside, so that it is not scanned again."""
        if blank := len(pending) - len(stripped):
            self._held += pending[:blank].encode()
            self._pending = stripped

    def _unhold(self) -> str:
        held = self._held.decode()
        self._drop_held()
        return held

    def _drop_held(self) -> None:
        self._held = bytearray()

    def _looking_for(self) -> tuple[str, ...]:
        if self._state == _REASONING:
            wanted: tuple[str, ...] = (THINK_CLOSE,)
        elif self._state == _CONTENT:
            wanted = (CALL_OPEN,)
        else:
            wanted = (CALL_CLOSE,)
        return tuple(tag for tag in wanted if tag in self._text_tags)

    def _next_tag(self, text: str, start: int) -> tuple[int, str] | None:
        hits = [(at, tag) for tag in self._looking_for() if (at := text.find(tag, start)) >= 0]
        return min(hits) if hits else None

    def _partial_tag(self, text: str, start: int) -> int:
        """Length of the longest tail of ``text[start:]`` that is a proper prefix of a tag looked for."""
        best = 0
        for tag in self._looking_for():
            for length in range(min(len(tag) - 1, len(text) - start), best, -1):
                if text.endswith(tag[:length]):
                    best = length
                    break
        return best

    def _release(self, text: str, out: DeltaList) -> None:
        if not text:
            return
        if self._state == _REASONING:
            out.reasoning(text)
        elif self._state == _CONTENT:
            out.content(text)
        else:
            self._body.append(text)

    # ------------------------------------------------------------------ tags

    def _tag(self, tag: str, out: DeltaList) -> None:
        """A tag where it stands; text tags are only ever looked for where they are valid, so only
        a tag id can be out of place (it is dropped and counted)."""
        state = self._state
        at_start, self._start = self._start, False
        if tag == THINK_OPEN and at_start and state != _CALL:
            self._state = _REASONING
        elif tag == THINK_CLOSE and state == _REASONING:
            self._state = _CONTENT
        elif tag == CALL_OPEN:
            if state == _REASONING:
                self._recoveries.add(kinds.MISSING_THINK_CLOSE)
            elif state == _CALL:
                self._end_call(out, closed=False)
            self._state, self._body, self._after_call = _CALL, [], False
        elif tag == CALL_CLOSE and state == _CALL:
            self._end_call(out, closed=True)
            self._state = _CONTENT
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _end_call(self, out: DeltaList, *, closed: bool) -> None:
        body, self._body = "".join(self._body), []
        self._after_call = True
        parsed = parse_call(body)
        if parsed is None:
            self._recoveries.add(kinds.INVALID_TOOL_CALL)
            out.content(CALL_OPEN + body + (CALL_CLOSE if closed else ""))
            return
        if not closed:
            self._recoveries.add(kinds.UNCLOSED_CALL)
        if not self._tools_enabled:
            self._recoveries.add(kinds.TOOL_CALL_NOT_ALLOWED)
            return
        name, arguments = parsed
        out.append(ToolCallDelta(self._calls, self._call_ids(), name, arguments))
        self._calls += 1


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a Hermes call body ``{"name": ..., "arguments": {...}}``, or None.

    ``arguments`` (or ``parameters``) keeps the model's spelling, compacted; a string holding a
    JSON object is accepted too; a missing or null one means no arguments.
    """
    try:
        value = _json.loads(body)
    except _json.JsonError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    members = dict(_json.members(_json.compact(body)))
    arguments = members.get("arguments", members.get("parameters"))
    if arguments is None or arguments == "null":
        return value["name"], "{}"
    if arguments.startswith("{"):
        return value["name"], arguments
    if arguments.startswith('"'):
        inner = _json.loads(arguments)
        if isinstance(inner, str) and _json.is_object(inner):
            return value["name"], _json.compact(inner)
    return None


def prompt_ends_in_think(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a ``<think>`` block open (DeepSeek-R1 and Qwen3 thinking
    templates do): then the answer starts in reasoning. A closed empty block (thinking off) is not."""
    return prompt_text.rstrip().endswith(THINK_OPEN)
