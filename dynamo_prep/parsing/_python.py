"""Pythonic tool calls read safely: ``name(key=literal, ...)`` to a name and a JSON arguments object,
and where a streamed call's arguments close. No eval: a small reader of Python literals, one pass,
nesting bounded. What is accepted and how it becomes JSON: docs/answers.md ("Pythonic").
"""

from __future__ import annotations

import json
import keyword
import re
import unicodedata
from typing import Any, Final, NamedTuple

__all__ = ["MAX_NESTING", "ArgumentsEnd", "NotACallError", "PythonCall", "parse_call"]

MAX_NESTING: Final = 100
"""Brackets open at once inside a call (its parentheses included); deeper is no call. Python's own
parser stops at 200 (the list and the call's parentheses included)."""

_WS = re.compile(r"[ \t\f\n]*")
_NAME = re.compile(r"[^\W\d]\w*")
_PREFIXED_QUOTE = re.compile(r"""(?i:rb|br|fr|rf|r|u|f|b)?('''|\"\"\"|'|")""")
_BODIES = {
    "'": re.compile(r"[^'\\\n]*(?:\\.[^'\\\n]*)*'", re.DOTALL),
    '"': re.compile(r'[^"\\\n]*(?:\\.[^"\\\n]*)*"', re.DOTALL),
    "'''": re.compile(r"[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''", re.DOTALL),
    '"""': re.compile(r'[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*"""', re.DOTALL),
}
_DIGITS = r"[0-9](?:_?[0-9])*"
_EXPONENT = rf"[eE][-+]?{_DIGITS}"
_FLOAT = rf"(?:{_DIGITS}\.(?:{_DIGITS})?|\.{_DIGITS})(?:{_EXPONENT})?|{_DIGITS}{_EXPONENT}"
_INT = r"0[xX](?:_?[0-9a-fA-F])+|0[bB](?:_?[01])+|0[oO](?:_?[0-7])+|0(?:_?0)*|[1-9](?:_?[0-9])*"
_NUMBER = re.compile(rf"(?P<float>{_FLOAT})(?P<imaginary>[jJ])?|(?P<int>{_INT})(?P<int_imaginary>[jJ])?")
_ESCAPE = re.compile(
    r"\\(?:(?P<simple>[\n\\'\"abfnrtv])|(?P<octal>[0-7]{1,3})|x(?P<x>[0-9a-fA-F]{2})|u(?P<u>[0-9a-fA-F]{4})"
    r"|U(?P<U>[0-9a-fA-F]{8})|N\{(?P<N>[^}\n]{1,100})\}|(?P<bad>[xuUN])|(?P<other>.))",
    re.DOTALL,
)
_SIMPLE = {"\n": "", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_SIMPLE |= {"t": "\t", "v": "\v"}
_NAMES = {"True": True, "False": False, "None": None}
_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON spellings some models write
_OPEN = {"[": "]", "(": ")", "{": "}"}


class NotACallError(ValueError):
    """The text is no pythonic call (it stays content)."""


class PythonCall(NamedTuple):
    name: str
    arguments: str
    """A compact JSON object."""
    repeated: int
    """Keywords given again (each keeps its first place and takes the later value, as vLLM reads it)."""


def parse_call(text: str) -> PythonCall:
    """The call ``text`` is, whole: ``name(key=value, ...)`` (a dotted name allowed; keyword arguments
    only, values Python literals or ``true``/``false``/``null``). Raises ``NotACallError``."""
    reader = _Reader(text.replace("\r\n", "\n").replace("\r", "\n"))  # as Python reads source
    name, arguments = reader.call()
    try:
        return PythonCall(name, _dumps(arguments), reader.repeated)
    except ValueError as exc:  # an integer of more than 4,300 digits (hexadecimal reads any length)
        raise NotACallError(str(exc)) from exc


def _dumps(value: dict[str, Any]) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): escaped, so the text stays UTF-8
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text


class _Reader:
    """One call's text read left to right; every method leaves ``at`` after what it read."""

    __slots__ = ("at", "repeated", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0
        self.repeated = 0

    def call(self) -> tuple[str, dict[str, Any]]:
        parts = [self._identifier()]
        while self._peek() == ".":
            self.at += 1
            parts.append(self._identifier())
        self._expect("(")
        arguments: dict[str, Any] = {}
        while self._peek() != ")":
            key = self._identifier()
            self._expect("=")
            if self._peek() == "=":  # a comparison
                raise NotACallError(key)
            self.repeated += key in arguments
            arguments[key] = self._value(1)[0]  # depth 1: the call's parentheses
            if self._peek() != ",":
                break
            self.at += 1
        self._expect(")")
        if self.at != len(self.text):
            raise NotACallError("text after the call")
        return ".".join(parts), arguments

    # -- tokens ----------------------------------------------------------------------------------

    def _peek(self) -> str:
        """The next character that is not whitespace ("" at the end); ``at`` is moved to it."""
        self.at = _WS.match(self.text, self.at).end()  # type: ignore[union-attr]
        return self.text[self.at : self.at + 1]

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            raise NotACallError(f"{char!r} expected at {self.at}")
        self.at += 1

    def _identifier(self) -> str:
        self._peek()
        found = _NAME.match(self.text, self.at)
        if found is None:
            raise NotACallError(f"a name expected at {self.at}")
        self.at = found.end()
        name = unicodedata.normalize("NFKC", found.group())
        if not name.isidentifier() or keyword.iskeyword(name):
            raise NotACallError(name)
        return name

    # -- values: (value, whether it is a constant: a dict key may only be one) -------------------

    def _value(self, depth: int) -> tuple[Any, bool]:
        char = self._peek()
        if not char:
            raise NotACallError("a literal expected at the end")
        if char in _OPEN:
            if depth >= MAX_NESTING:
                raise NotACallError("nested too deep")
            self.at += 1
            return self._container(char, depth + 1)
        if char in "+-":
            return self._signed(depth), False
        if char.isdigit() or (char == "." and self.text[self.at + 1 : self.at + 2].isdigit()):
            return self._number(), True
        if _PREFIXED_QUOTE.match(self.text, self.at):
            return self._strings()
        name = _NAME.match(self.text, self.at)
        word = name.group() if name is not None else ""
        if word in _NAMES or word in _JSON_NAMES:
            self.at += len(word)
            return (_NAMES[word], True) if word in _NAMES else (_JSON_NAMES[word], False)
        raise NotACallError(f"a literal expected at {self.at}")

    def _container(self, opener: str, depth: int) -> tuple[Any, bool]:
        closer = _OPEN[opener]
        if self._peek() == closer:
            self.at += 1
            return {} if opener == "{" else [], False
        first, constant = self._value(depth)
        if opener == "(" and self._peek() == ")":  # parentheses around one value: that value
            self.at += 1
            return first, constant
        if opener == "{" and self._peek() == ":":
            return self._dict(first, constant, depth), False
        items = [first]
        while self._peek() == ",":
            self.at += 1
            if self._peek() == closer:
                break
            items.append(self._value(depth)[0])
        self._expect(closer)
        return items, False  # a list, a tuple or a set: a JSON array, in the order written

    def _dict(self, key: Any, constant: bool, depth: int) -> dict[Any, Any]:
        found: dict[Any, Any] = {}
        while True:
            if not constant:
                raise NotACallError("a dict key that is no literal")
            self._expect(":")
            found[key] = self._value(depth)[0]  # a key written twice: its first place, the later value
            if self._peek() != ",":
                break
            self.at += 1
            if self._peek() == "}":
                break
            key, constant = self._value(depth)
        self._expect("}")
        return found

    def _signed(self, depth: int) -> int | float:
        negative = False
        while (char := self._peek()) in ("+", "-") and char:
            negative ^= char == "-"
            self.at += 1
        value, _ = self._value(depth)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise NotACallError("a sign before no number")
        return -value if negative else value

    def _number(self) -> int | float:
        found = _NUMBER.match(self.text, self.at)
        if found is None or found["imaginary"] or found["int_imaginary"]:
            raise NotACallError(f"a number expected at {self.at}")
        self.at = found.end()
        if _NAME.match(self.text, self.at) or self.text[self.at : self.at + 1] == ".":
            raise NotACallError(f"a number runs into text at {self.at}")
        try:
            value: int | float = int(found["int"], 0) if found["int"] else float(found["float"])
        except ValueError as exc:  # more digits than Python converts (4,300)
            raise NotACallError(str(exc)) from exc
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            raise NotACallError("a number JSON cannot hold")
        return value

    def _strings(self) -> tuple[str, bool]:
        """Adjacent string literals, joined; an f-string makes the result no constant."""
        pieces: list[str] = []
        constant = True
        while (opening := _PREFIXED_QUOTE.match(self.text, self._at_string())) is not None:
            prefix = opening.group()[: opening.start(1) - opening.start()].lower()
            quote = opening.group(1)
            body = _BODIES[quote].match(self.text, opening.end())
            if body is None or "b" in prefix:
                raise NotACallError("a string that does not close, or bytes")
            self.at = body.end()
            raw = body.group()[: -len(quote)]
            if "f" in prefix:
                if "{" in raw or "}" in raw:
                    raise NotACallError("an f-string with replacement fields")
                constant = False
            pieces.append(raw if "r" in prefix else _unescape(raw))
        return "".join(pieces), constant

    def _at_string(self) -> int:
        """Where the next string literal would start (after whitespace), or past the end."""
        self._peek()
        return self.at


def _unescape(raw: str) -> str:
    if "\\" not in raw:
        return raw
    return _ESCAPE.sub(_escaped, raw)


def _escaped(found: re.Match[str]) -> str:
    if (simple := found["simple"]) is not None:
        return _SIMPLE[simple]
    if (octal := found["octal"]) is not None:
        return chr(int(octal, 8))
    if (code := found["x"] or found["u"] or found["U"]) is not None:
        if int(code, 16) > 0x10FFFF:
            raise NotACallError("an escape beyond Unicode")
        return chr(int(code, 16))
    if (name := found["N"]) is not None:
        try:
            return unicodedata.lookup(name)
        except KeyError as exc:
            raise NotACallError("an unknown character name") from exc
    if found["bad"] is not None:
        raise NotACallError("a truncated escape")
    return found.group()  # an unknown escape keeps its backslash, as Python does


_OUTSIDE = re.compile(r"""[()\[\]{}'"]""")
_IN_STRING = {
    ("'", False): re.compile(r"[\\'\n]"),
    ('"', False): re.compile(r'[\\"\n]'),
    ("'", True): re.compile(r"[\\']"),
    ('"', True): re.compile(r'[\\"]'),
}
OPEN: Final = -1
REFUSED: Final = -2


class ArgumentsEnd:
    """Where a call's arguments close, fed the text after its ``(`` piece by piece: each character is
    looked at once (strings, triple-quoted strings and escapes skipped, brackets counted).

    ``feed`` returns the index just past the closing ``)``, ``OPEN`` while it is still open, or
    ``REFUSED`` when the text can be no call (a bracket closes the call, nesting beyond
    ``MAX_NESTING``, a line break inside a one-line string)."""

    __slots__ = ("_depth", "_escaped", "_opening", "_quote", "_run", "_triple")

    def __init__(self) -> None:
        self._depth = 1
        self._quote = ""  # inside a string: its quote character
        self._triple = False
        self._opening = 0  # outside: quote characters seen that may still open a triple-quoted string
        self._run = 0  # inside a triple-quoted string: quote characters just seen
        self._escaped = False

    def feed(self, text: str, at: int = 0) -> int:
        size = len(text)
        while at < size:
            if self._opening:
                at = self._open_string(text, at)
            elif self._escaped:
                self._escaped = False
                at += 1
            elif self._quote:
                at = self._in_string(text, at)
            else:
                found = _OUTSIDE.search(text, at)
                if found is None:
                    return OPEN
                at = found.end()
                char = found.group()
                if char in "'\"":
                    self._quote, self._opening = char, 1
                elif char in _OPEN:
                    self._depth += 1
                    if self._depth > MAX_NESTING:
                        return REFUSED
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        return at if char == ")" else REFUSED
            if at < 0:
                return REFUSED
        return OPEN

    def _open_string(self, text: str, at: int) -> int:
        """After one or two quotes outside a string: a third opens a triple-quoted string, anything
        else a one-line string (one quote) or ends an empty one (two)."""
        if text[at] == self._quote:
            self._opening += 1
            if self._opening == 3:
                self._opening, self._triple, self._run = 0, True, 0
            return at + 1
        if self._opening == 2:
            self._quote = ""
        self._opening = 0
        return at

    def _in_string(self, text: str, at: int) -> int:
        found = _IN_STRING[self._quote, self._triple].search(text, at)
        if found is None:
            self._run = 0
            return len(text)
        char = found.group()
        if char == "\\":
            self._escaped, self._run = True, 0
        elif char == "\n":
            return -1  # a line break in a one-line string: Python refuses it
        elif not self._triple:
            self._quote = ""
        else:
            self._run = self._run + 1 if found.start() == at else 1
            if self._run == 3:
                self._quote, self._triple = "", False
        return found.end()
