"""Injection-safe segments of a Jinja render: special tokens come only from the template.

Rules (the reasoning is in ``docs/jinja-injection-safety.md``):

* The rendered text is byte-identical to transformers'. It is cut at the special-token strings the
  TEMPLATE emitted (one control segment each); everything between them is one text segment. So
  the ids equal transformers' whole-string ids unless user text spells a special, and then only
  that span differs: it stays plain BPE.
* User strings are every string (values and keys) in the messages, tools, documents and the
  request's template variables (``chat_template_kwargs``), except ``role`` and ``type`` values
  from ``STRUCTURAL_VALUES``.
* Fast path: when no user string is ``suspicious`` (holds an end character of a special, or is a
  piece of one while the template writes partial specials), every special in the render is the
  template's.
* Traced path: otherwise the template renders again with each suspicious string wrapped in
  private-use sentinels (``_Marked``); the stripped render must equal the plain one and the
  sentinels must nest, or the request is refused with a ``PromptRenderError`` (never a silent
  whole-string encode). Specials are matched only outside sentinel spans.
* Not detected: a template that slices an ordinary user string and rebuilds a special from the
  slice and its own partial-special text (``'<|' + content[1:-1] + '|>'``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jinja2
import msgspec
import structlog

from dynamo_prep.formatter.jinja.environment import render_template
from dynamo_prep.prompt import PromptRenderError, Segment

__all__ = ["STRUCTURAL_VALUES", "USER_INPUTS", "SpecialTokens", "injection_safe_segments"]

log = structlog.get_logger("dynamo_prep.formatter.jinja")

# role/type values that are structure, not user text (any other value is treated as user text)
STRUCTURAL_VALUES: Mapping[str, frozenset[str]] = {
    "role": frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"}),
    "type": frozenset(
        {"text", "image", "image_url", "video", "video_url", "audio", "input_audio", "function"}
    ),
}
# the template variables that hold the request's own input (a request's template variables too)
USER_INPUTS = ("messages", "tools", "documents")
_KEPT_TEXT_CHARS = 32
_KEPT_SEGMENTS = 4096
# (start, end) sentinel pairs tried in order; the first pair absent from the request is used
_SENTINEL_PAIRS = (("\ue000", "\ue001"), ("\U000f0000", "\U000f0001"), ("\U00100000", "\U00100001"))


class _Marked(str):
    """A user string wrapped in sentinels, behaving for the template like the unwrapped string.

    The str value (what ``str()``, concatenation, ``tojson`` and output see) carries the
    sentinels; every method and operator a template can reach works on the unwrapped text and
    wraps the strings it derives, so control flow and filters decide as on the plain render.
    """

    _inner: str
    _pair: tuple[str, str]

    def __new__(cls, inner: str, pair: tuple[str, str]) -> _Marked:
        marked = super().__new__(cls, pair[0] + inner + pair[1])
        marked._inner = inner
        marked._pair = pair
        return marked

    def _wrap(self, value: Any) -> Any:
        if type(value) is str:
            return _Marked(value, self._pair) if value else value
        if isinstance(value, list | tuple):
            return type(value)(self._wrap(item) for item in value)
        return value

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[str]:
        return (_Marked(char, self._pair) for char in self._inner)

    def __getitem__(self, key: Any) -> Any:
        return self._wrap(self._inner[key])

    def __hash__(self) -> int:
        return hash(self._inner)

    def __repr__(self) -> str:  # printing a list or dict of user strings keeps them traced
        return self._pair[0] + repr(self._inner) + self._pair[1]

    def __contains__(self, item: object) -> bool:
        return _unmarked(item) in self._inner


def _unmarked(value: Any) -> Any:
    return value._inner if isinstance(value, _Marked) else value


def _derived(name: str) -> Callable[..., Any]:
    method = getattr(str, name)

    def call(self: _Marked, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(method(self._inner, *map(_unmarked, args), **kwargs))

    call.__name__ = name
    return call


def _query(name: str) -> Callable[..., Any]:
    method = getattr(str, name)

    def call(self: _Marked, *args: Any, **kwargs: Any) -> Any:
        return method(self._inner, *map(_unmarked, args), **kwargs)

    call.__name__ = name
    return call


_DERIVED_METHODS = (
    *("capitalize", "casefold", "center", "expandtabs", "ljust", "lower", "lstrip", "removeprefix"),
    *("removesuffix", "replace", "rjust", "rstrip", "strip", "swapcase", "title", "translate", "upper"),
    *("zfill", "split", "rsplit", "splitlines", "partition", "rpartition"),
)
_QUERY_METHODS = (
    *("count", "endswith", "find", "index", "rfind", "rindex", "startswith", "encode", "isalnum"),
    *("isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric"),
    *("isprintable", "isspace", "istitle", "isupper", "__eq__", "__ne__", "__lt__", "__le__"),
    *("__gt__", "__ge__"),
)
for _name in _DERIVED_METHODS:
    setattr(_Marked, _name, _derived(_name))
for _name in _QUERY_METHODS:
    setattr(_Marked, _name, _query(_name))


class SpecialTokens:
    """The special-token strings of a model: where they occur, and which user text could forge one."""

    def __init__(self, specials: Iterable[str], *, inner_pieces: bool = True) -> None:
        self.strings = tuple(sorted({s for s in specials if s}, key=lambda s: (-len(s), s)))
        self.inner_pieces = inner_pieces
        self._pattern = re.compile(_longest_first(self.strings)) if self.strings else None
        self._splitter = re.compile(f"({_longest_first(self.strings)})") if self.strings else None
        self._controls = {special: Segment(special, True) for special in self.strings}
        self._segments: dict[str, Segment] = dict(self._controls)  # and short text segments seen
        edges = {char for s in self.strings for char in (s[0], s[-1])}
        edges |= {variant for char in edges for variant in (char.lower(), char.upper(), char.casefold())}
        self._edges = re.compile("[" + "".join(map(re.escape, sorted(edges))) + "]") if edges else None
        self._edge_bytes = tuple(_utf8(sorted(edges)))
        # characters JSON escapes (so a search of the JSON text would miss them)
        self._json_edges = any(char in '"\\' or ord(char) < 0x20 for char in edges)
        self._joined = "\x00".join(self.strings)
        self._longest = max(map(len, self.strings), default=0)

    def suspicious(self, text: str) -> bool:
        """Whether ``text`` could be part of a special occurrence (it holds an end or sits inside one)."""
        if self._edges is None or not text:
            return False
        if self._edges.search(text) is not None:
            return True
        return self.inner_pieces and len(text) < self._longest and text in self._joined

    def clean_json(self, value: Any) -> bool:
        """A quick all-clear for a whole request: its JSON holds no end character of any special.

        JSON text keeps every character but quotes, backslashes and control characters, so unless a
        special starts or ends with one of those, a clean JSON text means no string inside it is
        suspicious (punctuation JSON adds can only raise false alarms). Otherwise (or when the value is
        not JSON-encodable), the caller checks string by string.
        """
        if self._edges is None:
            return True
        if self.inner_pieces or self._json_edges:
            return False
        try:
            encoded = msgspec.json.encode(value)
        except (TypeError, ValueError, msgspec.EncodeError):
            return False
        # UTF-8 is self-synchronizing: a character's bytes occur only where the character does
        return not any(edge in encoded for edge in self._edge_bytes)

    def fragments_in(self, source: str) -> bool:
        """Whether template source writes a special's first or last two characters outside a whole special.

        Only such a template (``'<|' + role + '|>'``) can build a special around user text that
        holds neither of its ends; for any other, pieces of specials in user text are harmless.
        """
        rest = self._pattern.sub("", source) if self._pattern is not None else source
        return any(s[:2] in rest or s[-2:] in rest for s in self.strings)

    def cut(self, text: str, segments: list[Segment]) -> None:
        """Append ``text`` as control segments (each special) and text segments (the runs between)."""
        if self._splitter is None:
            if text:
                segments.append(Segment(text, False))
            return
        # text, special, text, ..., text: a text run never equals a special (the split would have cut it)
        known, text_segment = self._segments, self._text_segment
        parts = self._splitter.split(text)
        segments.extend([known.get(part) or text_segment(part) for part in parts if part])

    def _text_segment(self, text: str) -> Segment:
        """A text segment; short ones (tags, newlines, roles) are kept, as the same few recur."""
        segment = Segment(text, False)
        if len(text) <= _KEPT_TEXT_CHARS:
            if len(self._segments) >= _KEPT_SEGMENTS:
                self._segments = dict(self._controls)
            self._segments[text] = segment
        return segment


def _longest_first(strings: Iterable[str]) -> str:
    """A regex matching, at each position, the longest of ``strings`` that occurs there: a trie of
    them (one branch per next character), so a position costs one character test per level instead
    of one attempt per string."""
    trie: dict[str, Any] = {}
    for string in strings:
        node = trie
        for char in string:
            node = node.setdefault(char, {})
        node[""] = {}  # a string ends here ("" is never a character)

    def branch(node: dict[str, Any]) -> str:
        alternatives = [re.escape(char) + branch(child) for char, child in sorted(node.items()) if char]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
        return f"(?:{body})?" if "" in node else body  # greedy: a longer string first

    return branch(trie)


def _utf8(chars: Iterable[str]) -> list[bytes]:
    """The UTF-8 bytes of each character that has them (a lone surrogate does not, nor does any JSON)."""
    encoded = []
    for char in chars:
        try:
            encoded.append(char.encode("utf-8"))
        except UnicodeEncodeError:
            continue
    return encoded


def _user_strings(value: Any, key: Any = None) -> Iterator[str]:
    """Every string the client sent, keys included, except structural role/type values."""
    if isinstance(value, str):
        structural = STRUCTURAL_VALUES.get(key) if isinstance(key, str) else None
        if structural is None or value not in structural:
            yield value
    elif isinstance(value, Mapping):
        for item_key, item in value.items():
            yield from _user_strings(item_key)
            yield from _user_strings(item, item_key)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _user_strings(item)


def _mark(value: Any, specials: SpecialTokens, pair: tuple[str, str], key: Any = None) -> Any:
    """A copy of ``value`` with every suspicious user string wrapped in the sentinel ``pair``."""
    if isinstance(value, str):
        structural = STRUCTURAL_VALUES.get(key) if isinstance(key, str) else None
        if (structural is None or value not in structural) and specials.suspicious(value):
            return _Marked(value, pair)
        return value
    if isinstance(value, dict):
        return {
            _mark(item_key, specials, pair): _mark(item, specials, pair, item_key)
            for item_key, item in value.items()
        }
    if isinstance(value, list):
        return [_mark(item, specials, pair) for item in value]
    if isinstance(value, tuple):
        return tuple(_mark(item, specials, pair) for item in value)
    return value


def _sentinels(texts: Iterable[str]) -> tuple[str, str] | None:
    """The first sentinel pair that appears in none of ``texts``."""
    corpus = "".join(texts)
    for pair in _SENTINEL_PAIRS:
        if pair[0] not in corpus and pair[1] not in corpus:
            return pair
    return None


def _traced_segments(
    marked: str, plain: str, pair: tuple[str, str], specials: SpecialTokens
) -> list[Segment]:
    """Segments of a sentinel-marked render; specials are matched only outside user spans.

    Raises ``PromptRenderError`` when the sentinels do not nest or the stripped render is not
    byte-identical to ``plain`` (the template transformed user text in a way they cannot follow).
    """
    pieces: list[tuple[str, bool]] = []  # (text, is_user)
    depth = 0
    for index, part in enumerate(re.split(f"({re.escape(pair[0])}|{re.escape(pair[1])})", marked)):
        if index % 2:
            depth += 1 if part == pair[0] else -1
            if depth < 0:
                break
        elif part:
            pieces.append((part, depth > 0))
    if depth != 0 or "".join(text for text, _ in pieces) != plain:
        raise PromptRenderError(
            "this model's chat template transforms message text in a way that cannot be traced, and "
            "the request contains text that looks like the model's special tokens; remove that text "
            "(or serve the model with Hugging Face tokenization parity)"
        )
    segments: list[Segment] = []
    for text, is_user in pieces:
        if is_user:
            segments.append(Segment(text, False))
        else:
            specials.cut(text, segments)
    return _merge_text(segments)


def _merge_text(segments: list[Segment]) -> list[Segment]:
    """Adjacent text segments joined, so BPE sees the same runs as a whole-string encode."""
    merged: list[Segment] = []
    for segment in segments:
        if merged and not segment.allow_special and not merged[-1].allow_special:
            merged[-1] = Segment(merged[-1].text + segment.text, False)
        else:
            merged.append(segment)
    return merged


def injection_safe_segments(
    template: jinja2.Template,
    context: dict[str, Any],
    text: str,
    specials: SpecialTokens,
    user_keys: Iterable[str] = USER_INPUTS,
) -> list[Segment]:
    """Segments of ``text`` (``template`` rendered with ``context``) where only the template's specials
    are control segments: the fast path when no user string could touch a special, else a traced render.
    ``user_keys`` name the variables of ``context`` that hold user input (the request's template
    variables among them)."""
    user_inputs = {key: context[key] for key in dict.fromkeys(user_keys)}
    segments: list[Segment] = []
    if specials.clean_json(user_inputs):
        specials.cut(text, segments)
        return segments
    suspicious = [value for value in _user_strings(user_inputs) if specials.suspicious(value)]
    if not suspicious:
        specials.cut(text, segments)
        return segments
    pair = _sentinels([text, *_user_strings(user_inputs)])
    if pair is None:
        raise PromptRenderError("the request contains the private-use characters used to trace user text")
    marked = {key: _mark(value, specials, pair) for key, value in user_inputs.items()}
    traced = render_template(template, {**context, **marked})
    try:
        return _traced_segments(traced, text, pair, specials)
    except PromptRenderError:
        log.warning("jinja_untraceable_user_text", suspicious=len(suspicious))
        raise
