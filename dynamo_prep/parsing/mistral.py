"""Mistral tool calls (``mistral``) and reasoning (``mistral``): ``[TOOL_CALLS]`` then a JSON array of
``{"name", "arguments"}`` (tokenizers before v11), or ``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later,
``[CALL_ID]id`` before ``[ARGS]`` where the tokenizer has it); reasoning in ``[THINK]...[/THINK]``.

Every marker is a control token: it is matched on its id only, never in text, so text can never
fake one. A call is released whole once its JSON closes; what is no call is content, as written
(the control tokens dropped), counted. Call ids are Mistral's: 9 alphanumeric characters, as the
family's chat templates require when a call is sent back. Grammar, recoveries and how this differs
from vLLM's parser: docs/answers.md.
"""

from __future__ import annotations

import secrets
import string
from typing import Final

from dynamo_prep.parsing import _json
from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import DeltaList
from dynamo_prep.parsing._calls import ObjectEnd, call_of, json_call
from dynamo_prep.parsing._halves import ParseOptions, ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing.think import ThinkTagReasoning

__all__ = [
    "ARGS",
    "CALL_ID",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TOOL_CALLS",
    "MistralReasoning",
    "MistralTools",
    "mistral_call_id",
]

TOOL_CALLS: Final = "[TOOL_CALLS]"
ARGS: Final = "[ARGS]"
CALL_ID: Final = "[CALL_ID]"
THINK_OPEN: Final = "[THINK]"
THINK_CLOSE: Final = "[/THINK]"
CALL_ID_ALPHABET: Final = string.ascii_letters + string.digits
CALL_ID_LENGTH: Final = 9


def mistral_call_id() -> str:
    """9 random alphanumeric characters: what Mistral's templates (and mistral-common) accept (one
    draw from the system's randomness, written in base 62)."""
    value = secrets.randbelow(len(CALL_ID_ALPHABET) ** CALL_ID_LENGTH)
    digits = []
    for _ in range(CALL_ID_LENGTH):
        value, digit = divmod(value, len(CALL_ID_ALPHABET))
        digits.append(CALL_ID_ALPHABET[digit])
    return "".join(digits)


class MistralReasoning(ThinkTagReasoning):
    """``[THINK]...[/THINK]`` (Magistral, Mistral Small 3.2): control tokens, matched on their ids only.

    As vLLM reads it, a ``[THINK]`` anywhere outside reasoning opens reasoning (not only at the start);
    whatever the tool half was reading goes on after ``[/THINK]``.
    """

    OPEN = THINK_OPEN
    CLOSE = THINK_CLOSE

    def _looking_for(self) -> tuple[str, ...]:
        return ()  # control tokens: a vocabulary without them has no Mistral reasoning

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        if marker == self.OPEN and not self.in_reasoning and not self._start:
            self.in_reasoning, self.passing = True, False
            return
        super()._on_marker(marker, out)


# Where the tool half stands: content; after a call (whitespace held); right after [TOOL_CALLS]
# (whitespace read, the form not known yet); a name; a model-written call id; after [ARGS] (before
# its "{"); inside the arguments object; inside the JSON form's array (or object).
_TEXT, _AFTER, _START, _NAME, _ID, _ARGS_START, _ARGS, _JSON = range(8)
_IN_CALL: Final = frozenset((_START, _NAME, _ID, _ARGS_START, _ARGS, _JSON))
_JSON_OPENERS: Final = "[{"


class MistralTools(ToolHalf):
    """Content, and calls after each ``[TOOL_CALLS]``: a JSON array (or one object) of calls, or
    ``name[ARGS]{...}`` (``name{...}`` too, as vLLM accepts it). Text after the calls is content,
    except whitespace alone."""

    MARKERS = (TOOL_CALLS, ARGS, CALL_ID)
    OPENERS = (TOOL_CALLS,)

    @staticmethod
    def new_call_id() -> str:
        return mistral_call_id()

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._state = _TEXT
        self._held = bytearray()  # whitespace after a call (UTF-8), content if text follows
        self._name = bytearray()  # the call's text before its arguments (UTF-8), model's call id included
        self._name_end = -1  # where the name ends in it when a [CALL_ID] follows the name
        self._body = bytearray()  # the arguments object, or the JSON form's value (UTF-8)
        self._object_end = ObjectEnd()

    def _looking_for(self) -> tuple[str, ...]:
        return ()  # control tokens: matched on their ids, never in text

    # -- text --------------------------------------------------------------------------------------

    def _on_text(self, text: str, out: DeltaList) -> None:
        at = 0
        while at < len(text):
            state = self._state
            if state == _TEXT:
                out.content(text[at:] if at else text)
                return
            if state == _AFTER:
                at = self._read_after(text, at, out)
            elif state in (_START, _ARGS_START):
                at = self._read_opening(text, at, out)
            elif state == _NAME:
                at = self._read_name(text, at)
            elif state == _ID:
                self._name += text[at:].encode()
                return
            else:
                at = self._read_json(text, at, out)

    def _read_after(self, text: str, at: int, out: DeltaList) -> int:
        rest = text[at:]
        if not rest.strip():
            self._held += rest.encode()
            return len(text)
        if self._held:
            out.content(self._held.decode())
            self._held.clear()
        self._state = _TEXT
        return at

    def _read_opening(self, text: str, at: int, out: DeltaList) -> int:
        """Whitespace, then (after ``[TOOL_CALLS]``) ``[``/``{`` opens the JSON form and anything else a
        name; (after ``[ARGS]``) ``{`` opens the arguments and anything else is no call."""
        start = at
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            self._blank(text[start:])
            return at
        char = text[at]
        if self._state == _START and char not in _JSON_OPENERS:
            self._name += text[start:at].encode()
            self._state = _NAME
            return at
        self._body += text[start:at].encode()
        if char == "{" or (self._state == _START and char == "["):
            self._state = _ARGS if self._state == _ARGS_START else _JSON
            self._object_end = ObjectEnd()
            return at
        self._no_call(out)  # [ARGS] followed by no object
        return at

    def _blank(self, text: str) -> None:
        (self._name if self._state == _START else self._body).extend(text.encode())

    def _read_name(self, text: str, at: int) -> int:
        """The name runs up to ``[ARGS]``/``[CALL_ID]``, or a ``{`` (``name{...}``, as vLLM accepts)."""
        brace = text.find("{", at)
        if brace < 0:
            self._name += text[at:].encode()
            return len(text)
        self._name += text[at:brace].encode()
        self._state, self._object_end = _ARGS, ObjectEnd()
        return brace

    def _read_json(self, text: str, at: int, out: DeltaList) -> int:
        end = self._object_end.feed(text, at)
        if end < 0:
            self._body += text[at:].encode()
            return len(text)
        self._body += text[at:end].encode()
        self._end_json(out, closed=True)
        return end

    # -- markers -----------------------------------------------------------------------------------

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        state = self._state
        if marker == TOOL_CALLS:
            if state in _IN_CALL:
                self._interrupted(out)
            self._held.clear()  # whitespace after a call, then more calls: dropped
            self._state = _START
        elif marker == ARGS and state in (_NAME, _ID):
            self._state = _ARGS_START
        elif marker == CALL_ID and state == _NAME:
            self._state, self._name_end = _ID, len(self._name)
        elif state in _IN_CALL:
            self._no_call(out)  # [ARGS] or [CALL_ID] where the call has none
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        self._held.clear()
        if self._state in _IN_CALL:
            if cut:  # a call cut by max_tokens is never half sent
                self._clear()
            elif self._state == _JSON:
                self._end_json(out, closed=False)
            else:
                self._no_call(out)
        self._state = _TEXT

    # -- calls -------------------------------------------------------------------------------------

    def _end_json(self, out: DeltaList, *, closed: bool) -> None:
        """The arguments object (``name[ARGS]{...}``), or the JSON form's value, closed (or, not
        ``closed``, the model ended inside it: an array whose calls are all complete is recovered)."""
        body = self._body.decode()
        if self._state == _ARGS:
            name = self._name[: self._name_end if self._name_end >= 0 else None].decode().strip()
            calls = [(name, _json.compact(body))] if name and _json.is_object(body) else None
        else:
            calls = json_calls(body) if closed else _unclosed_calls(body)
            if calls is not None and not closed:
                self._recoveries.add(kinds.UNCLOSED_CALL)
        if calls is None:
            self._no_call(out)
            return
        self._clear()
        self._state = _AFTER
        for name, arguments in calls:
            self._call(name, arguments, out)

    def _interrupted(self, out: DeltaList) -> None:
        """``[TOOL_CALLS]`` inside a call: the call so far is no call, unless it is only whitespace."""
        if self._state == _START:
            self._clear()
            return
        self._no_call(out)

    def _no_call(self, out: DeltaList) -> None:
        """What was read of the call is content, as written (the control tokens dropped), and so is
        what follows, up to the next ``[TOOL_CALLS]``."""
        self._recoveries.add(kinds.INVALID_TOOL_CALL)
        if written := (self._name + self._body).decode():
            out.content(written)
        self._clear()
        self._state = _TEXT

    def _clear(self) -> None:
        self._name.clear()
        self._body.clear()
        self._name_end = -1


def json_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls of the JSON form: an array of ``{"name", "arguments"}`` objects (or one such object),
    every one a call (``json_call``: the model's spelling kept); None when any is not, or none is."""
    text = body.strip()
    if not text.startswith("["):
        parsed = json_call(text, arguments_required=False)
        return [parsed] if parsed is not None else None
    try:
        value = _json.loads(text)
    except _json.JsonError:
        return None
    if not isinstance(value, list) or not value:
        return None
    elements = _json.elements(_json.compact(text))
    if len(elements) != len(value):  # never, for a valid array: no call rather than a raise
        return None
    calls = [
        call_of(item, element, arguments_required=False)
        for item, element in zip(value, elements, strict=True)
    ]
    return None if any(call is None for call in calls) else [call for call in calls if call is not None]


def _unclosed_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls of an array the model left open after a complete call (``[{...}, {...}``)."""
    text = body.rstrip().removesuffix(",")
    return json_calls(text + "]") if text.lstrip().startswith("[") else None
