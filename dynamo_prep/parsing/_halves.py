"""The two halves a composed answer grammar is made of: a reasoning half reads the answer first and
hands on what is not reasoning; a tool half splits that into content and tool calls (vLLM's order).

Each half is fed decoded text and markers, in order (``text``, ``marker``, ``end``). A marker that
is one token arrives as a marker (matched on its id: text cannot fake it); a marker that is no
token is looked for in the text, and a tail that could still grow into one is held back until the
next text decides. A family subclasses ``ReasoningHalf`` or ``ToolHalf`` and implements four hooks;
the contract and a walk-through: docs/answers.md ("Adding a family").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dynamo_prep.parsing import _recoveries as kinds
from dynamo_prep.parsing._answer import CallIds, DeltaList, ToolCallDelta, new_call_id
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._schema_types import NO_TOOLS, ToolProperties

__all__ = ["Half", "NoReasoning", "NoTools", "ParseOptions", "ReasoningHalf", "ToolHalf"]


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """What one response's parser is told about its request and prompt.

    ``thinking``: the prompt opened the reasoning block (text before its close is reasoning).
    ``tools_enabled=False`` (``tool_choice: "none"``): every call is dropped, never content.
    ``tools_declared``: the request declared tools (a format that cannot tell a call from a JSON
    answer, ``ToolHalf.NEEDS_TOOLS``, parses calls only then).
    ``call_ids``: makes each call's id; None: the format's own (``ToolHalf.new_call_id``).
    ``thinking_requested``: the request's ``chat_template_kwargs`` asked for thinking (``thinking``
    or ``enable_thinking``), which is how vLLM's ``deepseek_v3`` reasoning parser decides.
    ``tool_properties``: the declared tools' property schemas, by name (``tool_properties``), for
    formats whose argument values are raw text typed by the schema (``qwen3_coder``).
    """

    thinking: bool = False
    tools_enabled: bool = True
    tools_declared: bool = True
    call_ids: CallIds | None = None
    thinking_requested: bool = False
    tool_properties: ToolProperties = field(default_factory=lambda: NO_TOOLS)


class Half:
    """Text and markers in, in order; subclasses implement the ``_on_*`` hooks and ``_looking_for``."""

    MARKERS: ClassVar[tuple[str, ...]] = ()
    """Every marker string this half reads (those that are one token are matched on their id)."""

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        self._options = options
        self._in_text = text_markers  # markers of the answer that are no token: looked for in text
        self._recoveries = recoveries
        self._pending = ""  # a tail that may still become a text marker
        self._filtered: dict[tuple[str, ...], tuple[str, ...]] = {}

    # -- what the composed parser (or the half before this one) calls -----------------------------

    def text(self, text: str, out: DeltaList) -> None:
        if self._pending:
            text, self._pending = self._pending + text, ""
        if not text:
            return
        wanted = self._text_wanted()
        for marker in wanted:
            if marker[0] in text:
                self._scan(text, out, final=False)
                return
        self._on_text(text, out)  # no text marker can start here: the common case, kept short

    def marker(self, marker: str, out: DeltaList) -> None:
        """A marker token: whatever text was held is text (no marker can complete it now)."""
        if self._pending:
            held, self._pending = self._pending, ""
            self._scan(held, out, final=True)
        self._on_marker(marker, out)

    def end(self, cut: bool, out: DeltaList) -> None:
        """The answer ended (``cut``: by max_tokens; a tail held as a possible marker is dropped then)."""
        if self._pending:
            held, self._pending = self._pending, ""
            if not cut:
                self._scan(held, out, final=True)
        self._on_end(cut, out)

    # -- hooks ----------------------------------------------------------------------------------

    def _looking_for(self) -> tuple[str, ...]:
        """The markers valid in the current state (those that are no token are searched in text)."""
        return ()

    def _on_text(self, text: str, out: DeltaList) -> None:
        raise NotImplementedError

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        raise NotImplementedError

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        raise NotImplementedError

    # -- the text scan ----------------------------------------------------------------------------

    def _text_wanted(self) -> tuple[str, ...]:
        wanted = self._looking_for()
        if not wanted:
            return wanted
        found = self._filtered.get(wanted)
        if found is None:
            found = self._filtered[wanted] = tuple(m for m in wanted if m in self._in_text)
        return found

    def _scan(self, text: str, out: DeltaList, *, final: bool) -> None:
        """Releases ``text`` up to each text marker valid where it stands; unless ``final``, holds back
        a tail that is a proper prefix of one. Each character is looked at a bounded number of times:
        where each marker next occurs is remembered, so a marker that never comes is searched once."""
        at = 0
        next_at: dict[str, int] = {}
        while True:
            wanted = self._text_wanted()
            if not wanted:
                if at < len(text):
                    self._on_text(text[at:] if at else text, out)
                return
            hit = _first(text, at, wanted, next_at)
            if hit is None:
                end = len(text) if final else len(text) - _partial(text, at, wanted)
                if end > at:
                    self._on_text(text[at:end], out)
                    if self._text_wanted() != wanted:  # the text changed what is looked for
                        at = end
                        continue
                self._pending = text[end:]
                return
            where, marker = hit
            if where > at:
                self._on_text(text[at:where], out)
            at = where + len(marker)
            if marker in self._text_wanted():
                self._on_marker(marker, out)
            else:  # the text before it ended the state it was valid in
                self._on_text(marker, out)


class ToolHalf(Half):
    """Content (``out.content(text)``) and tool calls (``self._call``, one whole call)."""

    OPENERS: ClassVar[tuple[str, ...]] = ()
    """Markers that start a call: one arriving inside reasoning ends the reasoning."""
    NEEDS_TOOLS: ClassVar[bool] = False
    """The format cannot tell a call from an answer in JSON: calls are parsed only when the request
    declares tools (else the half is ``NoTools``)."""

    def __init__(self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries) -> None:
        super().__init__(options, text_markers, recoveries)
        self._calls = 0
        self._call_ids = options.call_ids or self.new_call_id

    @staticmethod
    def new_call_id() -> str:
        """The id of a call in this format (OpenAI's ``call_`` + 24 hex unless the format wants others)."""
        return new_call_id()

    def _call(self, name: str, arguments: str, out: DeltaList, call_id: str | None = None) -> None:
        """One whole call (``arguments`` a JSON object text; ``call_id``: the model's own, else a new
        one); dropped, counted, when tools are disabled."""
        if not self._options.tools_enabled:
            self._recoveries.add(kinds.TOOL_CALL_NOT_ALLOWED)
            return
        out.append(ToolCallDelta(self._calls, call_id or self._call_ids(), name, arguments))
        self._calls += 1


class BetweenCalls:
    """Content after a tool call: whitespace alone there (the newlines between calls) is held, and
    released with the text that follows it; a tag or the answer's end drops it."""

    __slots__ = ("_held", "after_call")

    def __init__(self) -> None:
        self.after_call = False  # a call just ended: whitespace alone is not content
        self._held = bytearray()  # that whitespace (UTF-8), released if text follows

    def content(self, text: str, out: DeltaList) -> None:
        if self.after_call:
            if not text.strip():
                self._held += text.encode()
                return
            self.after_call = False
            if self._held:
                text = self._held.decode() + text
                self._held.clear()
        out.content(text)

    def drop_held(self) -> None:
        self._held.clear()


class NoTools(ToolHalf):
    """No tool-call format: everything is content."""

    def text(self, text: str, out: DeltaList) -> None:
        out.content(text)

    def _on_marker(self, marker: str, out: DeltaList) -> None:
        self._recoveries.add(kinds.UNKNOWN_TAG)

    def _on_end(self, cut: bool, out: DeltaList) -> None:
        return


class ReasoningHalf(Half):
    """Reasoning, then the rest handed to the tool half (``_pass_text`` / ``_pass_marker``).

    ``in_reasoning`` says whether text arriving now is reasoning (counted as reasoning tokens).
    """

    def __init__(
        self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries, tools: ToolHalf
    ) -> None:
        super().__init__(options, text_markers, recoveries)
        self._tools = tools
        self._tool_openers = frozenset(type(tools).OPENERS)
        self.in_reasoning = False
        self.passing = False
        """Text goes straight to the tool half now (the reasoning part is over for good): the
        composed parser then hands it there itself."""

    def _pass_text(self, text: str, out: DeltaList) -> None:
        self._tools.text(text, out)

    def _pass_marker(self, marker: str, out: DeltaList) -> None:
        self._tools.marker(marker, out)

    def _pass_end(self, cut: bool, out: DeltaList) -> None:
        self._tools.end(cut, out)

    def _tool_marker_in_reasoning(self, marker: str, out: DeltaList) -> None:
        """A tool half's marker inside reasoning: an opener ends the reasoning (counted) and is passed
        on; any other is dropped (counted)."""
        if marker in self._tool_openers:
            self._recoveries.add(kinds.MISSING_THINK_CLOSE)
            self.in_reasoning = False
            self._pass_marker(marker, out)
        else:
            self._recoveries.add(kinds.UNKNOWN_TAG)


class NoReasoning(ReasoningHalf):
    """No reasoning format: everything goes to the tool half as it comes."""

    def __init__(
        self, options: ParseOptions, text_markers: frozenset[str], recoveries: Recoveries, tools: ToolHalf
    ) -> None:
        super().__init__(options, text_markers, recoveries, tools)
        self.passing = True

    def text(self, text: str, out: DeltaList) -> None:
        self._tools.text(text, out)

    def marker(self, marker: str, out: DeltaList) -> None:
        self._tools.marker(marker, out)

    def end(self, cut: bool, out: DeltaList) -> None:
        self._tools.end(cut, out)


def _first(text: str, at: int, wanted: tuple[str, ...], next_at: dict[str, int]) -> tuple[int, str] | None:
    """The first of ``wanted`` in ``text[at:]`` (the longest where two start at one place).

    ``next_at`` remembers, per marker, where it was last found (-1: nowhere after where the search
    began); ``at`` only grows within one text, so a remembered place at or after ``at`` is still the
    next one, and each marker's search moves forward through the text once."""
    best: tuple[int, str] | None = None
    for marker in wanted:
        where = next_at.get(marker, -2)
        if where == -1:
            continue
        if where < at:
            where = next_at[marker] = text.find(marker, at)
            if where < 0:
                continue
        if best is None or where < best[0] or (where == best[0] and len(marker) > len(best[1])):
            best = (where, marker)
    return best


def _partial(text: str, at: int, wanted: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text[at:]`` that is a proper prefix of one of ``wanted``."""
    best = 0
    size = len(text)
    for marker in wanted:
        where = text.find(marker[0], max(at, size - len(marker) + 1), size - best)
        while where >= 0:
            if marker.startswith(text[where:]):
                best = size - where
                break
            where = text.find(marker[0], where + 1, size - best)
    return best
