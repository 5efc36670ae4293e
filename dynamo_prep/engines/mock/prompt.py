"""What the mock engine reads from a prompt: the conversation's shape, found on token ids.

Kimi-K3's markers (``<|open|>``, ``<|sep|>``, ``<|close|>``), ChatML's ``<|im_start|>`` /
``<|im_end|>`` and Llama's headers (Llama 3 ``<|start_header_id|>role<|end_header_id|>`` ...
``<|eot_id|>``, Llama 4 ``<|header_start|>`` ... ``<|eot|>``) are special ids that user text can
never produce (text segments are encoded as plain BPE), so message boundaries and headers found on
ids are the formatter's own: a user who types ``<|close|>message<|sep|>`` or ``<|im_start|>``
cannot move them. Only the text between them is decoded. One exception is the demo ChatML format's
tool results: ``<tool_response>`` is text there, so a user turn that starts with it reads as a tool
result (real Qwen vocabularies register those tags as tokens). Llama templates write the declared
tools as JSON in the system or first user turn: the first tool objects found there are read.

DeepSeek's turn and tool markers (``<｜User｜>``, ``<｜Assistant｜>``, ``<｜tool▁output▁begin｜>``, ...)
are added tokens: found on ids the same way; the declared tools are read from the system text's
``### NAME`` / ``Parameters: {json}`` lines (V3.1's template and the tests' one write them so).

Mistral's ``[INST]``/``[/INST]``, ``[AVAILABLE_TOOLS]`` and ``[TOOL_RESULTS]`` are control tokens
too: a Mistral prompt is read on them (the last user turn, the tools, the tool results that end it).

A prompt of another format is read as plain text: its last user message is the whole prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dynamo_prep.formatter.kimi_k3 import CLOSE, OPEN, SEP
from dynamo_prep.protocol.kv_events import placeholder_starts
from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "PromptReader",
    "PromptView",
    "Tool",
    "ToolResult",
    "count_occurrences",
    "strip_pattern",
]

Family = Literal["kimi_k3", "chatml", "deepseek", "llama3", "llama4", "mistral", "plain"]
Opened = Literal["message", "think", "response"]
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_ATTRIBUTE = re.compile(r'\s([\w-]+)="([^"]*)"')
_TOOLS_BLOCK = re.compile(r"```json\n(.*)\n```", re.DOTALL)
_TOOL_CHOICE = re.compile(r"`tool_choice=(\w+)`")
_CHATML_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_TOOL_RESPONSE_OPEN = "<tool_response>"
_CHATML_ASSISTANT = "assistant\n"
_MAX_ROLE_TOKENS = 8
DS_USER, DS_ASSISTANT, DS_EOS = "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
DS_OUTPUT, DS_OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
DS_THINK = "<think>"
_DS_TOOL_NAME, _DS_PARAMETERS = "### ", "Parameters: "
_MAX_TOOL_BLOCKS = 64  # JSON blocks tried in a Llama system / first user turn (each decoded once)
_TOOL_BLOCK = re.compile(r"^[{\[]", re.MULTILINE)
_HEADER_BLANK = "\n\n"  # what Llama templates write after a header


@dataclass(frozen=True, slots=True)
class _Headers:
    """A header-framed chat format: ``start`` role ``end`` text, closed by one of ``turn_ends``."""

    start: str
    end: str
    turn_ends: tuple[str, ...]


HEADERS: dict[Family, _Headers] = {
    "llama3": _Headers("<|start_header_id|>", "<|end_header_id|>", ("<|eot_id|>", "<|eom_id|>")),
    "llama4": _Headers("<|header_start|>", "<|header_end|>", ("<|eot|>", "<|eom|>")),
}
INST, INST_END = "[INST]", "[/INST]"
_MISTRAL_TURNS = {  # opener: (closer, role)
    INST: (INST_END, "user"),
    "[AVAILABLE_TOOLS]": ("[/AVAILABLE_TOOLS]", "tools"),
    "[TOOL_RESULTS]": ("[/TOOL_RESULTS]", "tool"),
}
_TOOL_CONTENT = "[TOOL_CONTENT]"


@dataclass(frozen=True, slots=True)
class Tool:
    """A declared tool: its name and its JSON-schema ``parameters`` (``{}`` when absent)."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool result of the run that ends the conversation (``name`` when the format carries it)."""

    name: str | None
    text: str


@dataclass(frozen=True, slots=True)
class PromptView:
    """The prompt as the mock needs it.

    ``last_user``: the full text of the last user message (image ids removed; for a plain prompt,
    the whole prompt). ``last_role``: the role of the last conversation message (internal system
    messages are not conversation). ``opened``: the element the prompt ends inside, when it ends
    in an assistant turn (K3: ``think`` or ``response`` channel, or ``message`` for the hosted
    form; ChatML: ``message``).
    """

    family: Family
    last_user: str = ""
    last_role: str | None = None
    tool_results: tuple[ToolResult, ...] = ()
    tools: tuple[Tool, ...] = ()
    tool_choice: str | None = None
    thinking: bool = False
    opened: Opened | None = None


@dataclass(slots=True)
class _Element:
    """One K3 element: ``<|open|>tag attrs<|sep|>`` ... ``<|close|>tag<|sep|>``; ``ids`` is its own text."""

    tag: str
    attrs: dict[str, str]
    start: int
    body_start: int
    ids: list[int] = field(default_factory=list)
    first_child: _Element | None = None


class PromptReader:
    """Reads prompts of one tokenizer's family; ``strip`` is the id sequence of one image."""

    def __init__(self, tokenizer: Tokenizer, *, kimi_k3: bool, strip: Sequence[int] | None) -> None:
        self.tokenizer = tokenizer
        self._strip = tuple(strip or ())
        specials = tokenizer.special_tokens
        self.family: Family = "plain"
        if kimi_k3 and all(marker in specials for marker in (OPEN, SEP, CLOSE)):
            self.family = "kimi_k3"
            self._open, self._sep, self._close = (specials[marker] for marker in (OPEN, SEP, CLOSE))
        elif IM_START in specials and IM_END in specials:
            self.family = "chatml"
            self._im_start, self._im_end = specials[IM_START], specials[IM_END]
        elif all(
            marker in tokenizer.added_tokens for marker in (DS_USER, DS_ASSISTANT, DS_OUTPUT, DS_OUTPUT_END)
        ):
            self.family = "deepseek"
            self._ds = {
                marker: tokenizer.added_tokens[marker] for marker in (DS_USER, DS_ASSISTANT, DS_OUTPUT)
            }
            self._ds_output_end = tokenizer.added_tokens[DS_OUTPUT_END]
            self._ds_ends = {tokenizer.added_tokens.get(DS_EOS), *tokenizer.eos_token_ids}
        elif INST in specials and INST_END in specials:
            self.family = "mistral"
        else:
            for family, headers in HEADERS.items():
                if all(marker in specials for marker in (headers.start, headers.end, *headers.turn_ends)):
                    self.family = family
                    self._start, self._end = specials[headers.start], specials[headers.end]
                    self._turn_ends = frozenset(specials[marker] for marker in headers.turn_ends)
                    break

    def read(self, token_ids: Sequence[int]) -> PromptView:
        if self.family == "kimi_k3":
            return self._read_k3(token_ids)
        if self.family == "chatml":
            return self._read_chatml(token_ids)
        if self.family == "deepseek":
            return self._read_deepseek(token_ids)
        if self.family in HEADERS:
            return self._read_headers(token_ids)
        if self.family == "mistral":
            return self._read_mistral(token_ids)
        return PromptView("plain", last_user=self._text(token_ids, skip_special_tokens=True))

    def generation_points(self, token_ids: Sequence[int]) -> list[int] | None:
        """Where a completion may have started, latest first (None: the format is unknown).

        K3: after the channel opener of the assistant turn the prompt ends in, then after that
        turn's header (the hosted form). ChatML: after ``<|im_start|>assistant\\n``.
        """
        if self.family == "kimi_k3":
            _, stack = self._k3_elements(token_ids)
            if not stack or not _is_assistant(stack[0]):
                return []
            message = stack[0]
            child = message.first_child
            points = [message.body_start]
            if child is not None and child.start == message.body_start and child.tag in ("think", "response"):
                points.insert(0, child.body_start)
            return points
        if self.family == "chatml":
            starts = [i for i, token_id in enumerate(token_ids) if token_id == self._im_start]
            if not starts:
                return []
            point = self._chatml_assistant_end(token_ids, starts[-1])
            return [] if point is None else [point]
        if self.family in HEADERS:
            turns, _ = self._header_turns(token_ids)
            if not turns or turns[-1].role != "assistant" or turns[-1].closed:
                return []
            return [self._after_blank(token_ids, turns[-1].body_start)]
        return None

    def _text(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        kept = strip_pattern(token_ids, self._strip)
        return self.tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)

    # --- Kimi-K3 ------------------------------------------------------------------------------

    def _read_k3(self, token_ids: Sequence[int]) -> PromptView:
        closed, stack = self._k3_elements(token_ids)
        messages = [element for element in closed if element.tag == "message"]
        # The first message of each internal type (the static tool-declare comes first).
        internal = {m.attrs["type"]: m for m in reversed(messages) if "type" in m.attrs}
        conversation = [element for element in messages if "type" not in element.attrs]
        users = [element for element in conversation if element.attrs.get("role") == "user"]
        last_role = conversation[-1].attrs.get("role") if conversation else None
        opened: Opened | None = None
        if stack and _is_assistant(stack[0]):
            inner = stack[-1].tag
            opened = "think" if inner == "think" else "response" if inner == "response" else "message"
        thinking = opened == "think" or (opened != "response" and "thinking-effort" in internal)
        declare = internal.get("tool-declare")
        choice = internal.get("tool-choice")
        choice_match = _TOOL_CHOICE.search(self._text(choice.ids)) if choice is not None else None
        return PromptView(
            "kimi_k3",
            last_user=self._text(users[-1].ids) if users else "",
            last_role=last_role,
            tool_results=tuple(self._k3_tool_results(conversation)) if last_role == "tool" else (),
            tools=_k3_tools(self._text(declare.ids)) if declare is not None else (),
            tool_choice=choice_match.group(1) if choice_match else None,
            thinking=thinking,
            opened=opened,
        )

    def _k3_tool_results(self, conversation: list[_Element]) -> list[ToolResult]:
        results: list[ToolResult] = []
        for element in reversed(conversation):
            if element.attrs.get("role") != "tool":
                break
            results.insert(0, ToolResult(element.attrs.get("tool"), self._text(element.ids)))
        return results

    def _k3_elements(self, token_ids: Sequence[int]) -> tuple[list[_Element], list[_Element]]:
        """The closed top-level elements, and the elements still open at the end (outermost first)."""
        closed: list[_Element] = []
        stack: list[_Element] = []
        position, end = 0, len(token_ids)
        while position < end:
            token_id = token_ids[position]
            if token_id not in (self._open, self._close):
                if stack:
                    stack[-1].ids.append(token_id)
                position += 1
                continue
            sep = _index(token_ids, self._sep, position + 1)
            if sep is None:
                break  # the prompt ends inside a tag
            head = self.tokenizer.decode(token_ids[position + 1 : sep])
            if token_id == self._open:
                element = _element(head, position, sep + 1)
                if stack and stack[-1].first_child is None:
                    stack[-1].first_child = element
                stack.append(element)
            else:
                _close_element(stack, closed, head.strip())
            position = sep + 1
        return closed, stack

    # --- ChatML ---------------------------------------------------------------------------------

    def _read_chatml(self, token_ids: Sequence[int]) -> PromptView:
        turns: list[tuple[str, str]] = []  # (role, text after the role line) of closed turns
        opened: Opened | None = None
        starts = [i for i, token_id in enumerate(token_ids) if token_id == self._im_start]
        for start in starts:
            end = _index(token_ids, self._im_end, start + 1)
            role, _, text = self._text(token_ids[start + 1 : end]).partition("\n")
            if end is None:
                opened = "message" if role == "assistant" else None
                break
            turns.append((role, text))
        conversation = turns[1:] if turns and turns[0][0] == "system" else turns
        users = [text for role, text in conversation if role == "user" and not _is_tool_turn(text)]
        last_role = None
        if conversation:
            role, text = conversation[-1]
            last_role = "tool" if role == "user" and _is_tool_turn(text) else role
        tools_match = _CHATML_TOOLS.search(turns[0][1]) if turns and turns[0][0] == "system" else None
        return PromptView(
            "chatml",
            last_user=users[-1] if users else "",
            last_role=last_role,
            tool_results=(
                tuple(ToolResult(None, text) for text in _TOOL_RESPONSE.findall(conversation[-1][1]))
                if last_role == "tool"
                else ()
            ),
            tools=_tools(_json_lines(tools_match.group(1))) if tools_match else (),
            opened=opened,
        )

    def _chatml_assistant_end(self, token_ids: Sequence[int], start: int) -> int | None:
        """The position after ``<|im_start|>assistant\\n`` at ``start``, or None for another role."""
        for width in range(1, _MAX_ROLE_TOKENS + 1):
            head = self.tokenizer.decode(token_ids[start + 1 : start + 1 + width])
            if head == _CHATML_ASSISTANT:
                return start + 1 + width
            if not _CHATML_ASSISTANT.startswith(head) or start + 1 + width >= len(token_ids):
                return None
        return None

    # --- DeepSeek -----------------------------------------------------------------------------

    def _read_deepseek(self, token_ids: Sequence[int]) -> PromptView:
        """Turns start at ``<｜User｜>``, ``<｜Assistant｜>`` and ``<｜tool▁output▁begin｜>`` (one per
        result); the prompt is open when it ends in an assistant turn that has not ended."""
        roles = {self._ds[DS_USER]: "user", self._ds[DS_ASSISTANT]: "assistant", self._ds[DS_OUTPUT]: "tool"}
        starts = [(i, roles[t]) for i, t in enumerate(token_ids) if t in roles]
        users = [i for i, role in starts if role == "user"]
        last_user = ""
        if users:
            end = next((i for i, _ in starts if i > users[-1]), len(token_ids))
            last_user = self._text(token_ids[users[-1] + 1 : end])
        turns = starts
        opened: Opened | None = None
        if (
            starts
            and starts[-1][1] == "assistant"
            and not self._ds_ends.intersection(token_ids[starts[-1][0] :])
        ):
            turns, opened = starts[:-1], "message"
        results: list[ToolResult] = []
        for start, role in reversed(turns):  # the last run of tool results
            if role != "tool":
                break
            close = _index(token_ids, self._ds_output_end, start + 1)
            results.insert(0, ToolResult(None, self._text(token_ids[start + 1 : close])))
        return PromptView(
            "deepseek",
            last_user=last_user,
            last_role=turns[-1][1] if turns else None,
            tool_results=tuple(results),
            tools=_tools(_deepseek_tools(self._text(token_ids[: users[0]]) if users else "")),
            thinking=self._text(token_ids[-2:]).rstrip().endswith(DS_THINK),
            opened=opened,
        )

    # --- Llama headers ------------------------------------------------------------------------------

    def _read_headers(self, token_ids: Sequence[int]) -> PromptView:
        turns, texts = self._header_turns(token_ids)
        closed = [(turn.role, text) for turn, text in zip(turns, texts, strict=True) if turn.closed]
        opened: Opened | None = None
        if turns and not turns[-1].closed and turns[-1].role == "assistant":
            opened = "message"
        tools: tuple[Tool, ...] = ()
        for index, (role, text) in enumerate(closed[:2]):
            if role in ("system", "user") and (found := _declared_tools(text))[0]:
                tools, tools_end = found
                if role == "user":  # the tools open the first user turn: the user's text follows
                    closed[index] = (role, text[tools_end:].strip())
                break
        conversation = [(role, text) for role, text in closed if role != "system"]
        users = [text for role, text in conversation if role == "user"]
        last_role = None
        if conversation:
            role = conversation[-1][0]
            last_role = "tool" if role in ("ipython", "tool") else role
        results: list[ToolResult] = []
        for role, text in reversed(conversation):
            if role not in ("ipython", "tool"):
                break
            results.insert(0, ToolResult(None, _tool_output(text)))
        return PromptView(
            self.family,
            last_user=users[-1] if users else "",
            last_role=last_role,
            tool_results=tuple(results),
            tools=tools,
            opened=opened,
        )

    def _header_turns(self, token_ids: Sequence[int]) -> tuple[list[_Turn], list[str]]:
        """Each header's turn (role, where its text starts, whether a turn end closed it) and text."""
        turns: list[_Turn] = []
        texts: list[str] = []
        starts = [i for i, token_id in enumerate(token_ids) if token_id == self._start]
        for number, start in enumerate(starts):
            limit = starts[number + 1] if number + 1 < len(starts) else len(token_ids)
            end = _index(token_ids, self._end, start + 1, limit)
            if end is None:
                continue
            close = next((i for i in range(end + 1, limit) if token_ids[i] in self._turn_ends), None)
            role = self._text(token_ids[start + 1 : end]).strip()
            body = token_ids[end + 1 : close if close is not None else limit]
            turns.append(_Turn(role, end + 1, close is not None))
            texts.append(self._text(body).removeprefix(_HEADER_BLANK))
        return turns, texts

    def _after_blank(self, token_ids: Sequence[int], at: int) -> int:
        """``at`` moved past the blank line a template writes after a header, when it is there."""
        for width in (1, 2):
            if self.tokenizer.decode(token_ids[at : at + width]) == _HEADER_BLANK:
                return at + width
        return at

    # --- Mistral ------------------------------------------------------------------------------------

    def _read_mistral(self, token_ids: Sequence[int]) -> PromptView:
        """Turns between Mistral's control tokens: what follows ``[/INST]`` up to ``</s>`` is the
        assistant's; the prompt's last turn is its last closed element (or an assistant turn)."""
        turns = self._mistral_turns(token_ids)
        conversation = [(role, text) for role, text in turns if role != "tools"]
        declared = [text for role, text in turns if role == "tools"]
        results: list[ToolResult] = []
        for role, text in reversed(conversation):
            if role != "tool":
                break
            results.insert(0, ToolResult(None, _mistral_tool_result(text)))
        users = [text for role, text in conversation if role == "user"]
        return PromptView(
            "mistral",
            last_user=users[-1] if users else "",
            last_role=conversation[-1][0] if conversation else None,
            tool_results=tuple(results),
            tools=_tools(_json_list(declared[-1])) if declared else (),
        )

    def _mistral_turns(self, token_ids: Sequence[int]) -> list[tuple[str, str]]:
        """(role, text) of each closed element, and of each assistant turn (the text after ``[/INST]``
        or ``[/TOOL_RESULTS]`` up to the end of sentence), in order."""
        specials = self.tokenizer.special_tokens
        closers = {closer: opener for opener, (closer, _) in _MISTRAL_TURNS.items()}
        markers = {specials[m]: m for m in (*_MISTRAL_TURNS, *closers) if m in specials}
        stops = set(self.tokenizer.eos_token_ids)
        turns: list[tuple[str, str]] = []
        opened: str | None = None  # the element open now (an opener), or "assistant"
        start = 0
        for index, token_id in enumerate(token_ids):
            marker = markers.get(token_id)
            if marker in _MISTRAL_TURNS:
                opened, start = marker, index + 1
            elif marker is not None and opened == closers[marker]:
                role = _MISTRAL_TURNS[opened][1]
                turns.append((role, self._text(token_ids[start:index])))
                opened, start = ("assistant" if role != "tools" else None), index + 1
            elif token_id in stops and opened == "assistant":
                turns.append(("assistant", self._text(token_ids[start:index], skip_special_tokens=True)))
                opened = None
        return turns


def _deepseek_tools(system: str) -> list[dict[str, Any]]:
    """``### NAME`` then (after a description) ``Parameters: {json}``, per tool."""
    found: list[dict[str, Any]] = []
    name: str | None = None
    for line in system.splitlines():
        if line.startswith(_DS_TOOL_NAME):
            name = line[len(_DS_TOOL_NAME) :].strip()
        elif line.startswith(_DS_PARAMETERS) and name:
            try:
                parameters = json.loads(line[len(_DS_PARAMETERS) :])
            except (ValueError, RecursionError):
                parameters = {}
            found.append({"name": name, "parameters": parameters})
            name = None
    return found


@dataclass(frozen=True, slots=True)
class _Turn:
    role: str
    body_start: int
    closed: bool


def _declared_tools(text: str) -> tuple[tuple[Tool, ...], int]:
    """The tools a Llama template wrote into ``text`` (JSON objects or a JSON list, each opening a
    line), and where the last of them ends; the first ``_MAX_TOOL_BLOCKS`` blocks are tried."""
    decoder = json.JSONDecoder()
    declared: list[Any] = []
    end = 0
    for tried, found in enumerate(_TOOL_BLOCK.finditer(text)):
        if tried == _MAX_TOOL_BLOCKS:
            break
        if found.start() < end:
            continue
        try:
            value, stop = decoder.raw_decode(text, found.start())
        except (ValueError, RecursionError):
            continue
        values = value if isinstance(value, list) else [value]
        if values and all(isinstance(v, dict) and ("function" in v or "parameters" in v) for v in values):
            declared.extend(values)
            end = stop
    return _tools(declared), end


def _tool_output(text: str) -> str:
    """A Llama tool result: the ``output`` of a ``{"output": ...}`` turn, else the turn's text."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if isinstance(value, dict) and isinstance(value.get("output"), str):
        return str(value["output"])
    return value if isinstance(value, str) else text


def count_occurrences(token_ids: Sequence[int], pattern: Sequence[int]) -> int:
    """Non-overlapping occurrences of ``pattern`` in ``token_ids``, scanning left to right."""
    return len(placeholder_starts(token_ids, pattern))


def strip_pattern(token_ids: Sequence[int], pattern: Sequence[int]) -> list[int]:
    """``token_ids`` without the non-overlapping occurrences of ``pattern``."""
    if not pattern:
        return list(token_ids)
    kept: list[int] = []
    previous = 0
    for start in placeholder_starts(token_ids, pattern):
        kept.extend(token_ids[previous:start])
        previous = start + len(pattern)
    kept.extend(token_ids[previous:])
    return kept


def _index(token_ids: Sequence[int], token_id: int, start: int, stop: int | None = None) -> int | None:
    for index in range(start, len(token_ids) if stop is None else stop):
        if token_ids[index] == token_id:
            return index
    return None


def _element(head: str, start: int, body_start: int) -> _Element:
    """An element from its header text: the tag, then `` key="value"`` attributes (unescaped)."""
    tag, _, rest = head.partition(" ")
    found = _ATTRIBUTE.findall(" " + rest)
    attrs = {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in found}
    return _Element(tag, attrs, start, body_start)


def _close_element(stack: list[_Element], closed: list[_Element], tag: str) -> None:
    """Pop up to the innermost open ``tag`` (an unmatched close is ignored); keep it if top-level."""
    if not any(element.tag == tag for element in stack):
        return
    while stack:
        element = stack.pop()
        if element.tag == tag:
            if not stack:
                closed.append(element)
            return


def _k3_tools(body: str) -> tuple[Tool, ...]:
    """The tools of a ``tool-declare`` body: the JSON list in its ```json block."""
    match = _TOOLS_BLOCK.search(body)
    if match is None:
        return ()
    try:
        declared = json.loads(match.group(1))
    except (ValueError, RecursionError):
        return ()
    return _tools(declared if isinstance(declared, list) else [])


def _json_lines(text: str) -> list[Any]:
    values: list[Any] = []
    for line in text.splitlines():
        try:
            values.append(json.loads(line))
        except (ValueError, RecursionError):
            continue
    return values


def _json_list(text: str) -> list[Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return []
    return value if isinstance(value, list) else []


def _mistral_tool_result(text: str) -> str:
    """A result's content: ``{"content": ..., "call_id": ...}`` (Mistral v3, v7, Nemo), or
    ``id[TOOL_CONTENT]content`` (Mistral Small 3.2)."""
    if _TOOL_CONTENT in text:
        return text.split(_TOOL_CONTENT, 1)[1]
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text.strip()
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else text.strip()


def _tools(declared: list[Any]) -> tuple[Tool, ...]:
    """OpenAI tool objects (``{"type": "function", "function": {...}}``, or the function itself)."""
    tools: list[Tool] = []
    for entry in declared:
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        tools.append(Tool(function["name"], parameters if isinstance(parameters, dict) else {}))
    return tuple(tools)


def _is_assistant(element: _Element) -> bool:
    return element.tag == "message" and element.attrs.get("role") == "assistant"


def _is_tool_turn(text: str) -> bool:
    return text.startswith(_TOOL_RESPONSE_OPEN)
