"""Pythonic tool calls read safely: ``name(key=literal, ...)`` to a name and a JSON arguments object,
and where a streamed call's arguments close. No eval: a small reader of Python literals (one regex
splits the call into tokens, a recursive descent reads them), nesting bounded. What is accepted and
how it becomes JSON: docs/answers.md ("Pythonic").
"""

from __future__ import annotations

import json
import keyword
import re
import unicodedata
from typing import Any, Final, NamedTuple

__all__ = ["MAX_NESTING", "OPEN", "REFUSED", "ArgumentsEnd", "NotACallError", "PythonCall", "parse_call"]

MAX_NESTING: Final = 100
"""Brackets open at once inside a call (its parentheses included); deeper is no call. Python's own
parser stops at 200 (the list and the call's parentheses included)."""

_WS = re.compile(r"[ \t\f\n]*")
_SINGLE = r"[^{q}\\\n]*(?:\\.[^{q}\\\n]*)*"
_TRIPLE = r"[^{q}\\]*(?:(?:\\.|{q}(?!{q}{q}))[^{q}\\]*)*"
# A one-line string never starts with what opens a triple-quoted one: that one must close as such.
_QUOTED = "|".join(
    (
        "'''" + _TRIPLE.format(q="'") + "'''",
        '"""' + _TRIPLE.format(q='"') + '"""',
        "'(?!'')" + _SINGLE.format(q="'") + "'",
        '"(?!"")' + _SINGLE.format(q='"') + '"',
    )
)
_DIGITS = r"[0-9](?:_?[0-9])*"
_EXPONENT = rf"[eE][-+]?{_DIGITS}"
_FLOAT = rf"(?:{_DIGITS}\.(?:{_DIGITS})?|\.{_DIGITS})(?:{_EXPONENT})?|{_DIGITS}{_EXPONENT}"
_INT = r"0[xX](?:_?[0-9a-fA-F])+|0[bB](?:_?[01])+|0[oO](?:_?[0-7])+|0(?:_?0)*|[1-9](?:_?[0-9])*"
_TOKEN = re.compile(
    r"[ \t\f\n]*(?:"
    rf"(?P<s>(?P<prefix>(?i:rb|br|fr|rf|r|u|f|b)?)(?:{_QUOTED}))"
    rf"|(?P<j>(?:{_FLOAT}|{_DIGITS})[jJ])|(?P<f>{_FLOAT})|(?P<i>{_INT})"
    r"|(?P<w>[^\W\d]\w*)"
    r"|(?P<p>[()\[\]{},:=.+-]))",
    re.DOTALL,
)
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
_SIGNS = (("p", "-"), ("p", "+"))


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


Token = tuple[str, str]
"""(kind, text): ``s`` a string literal (its prefix, lowercased, then a space, then the quoted text),
``f`` a float, ``i`` an integer, ``j`` an imaginary number, ``w`` a name, ``p`` punctuation, ``$``
the end."""
_END: Final[Token] = ("$", "")


def _tokens(text: str) -> list[Token]:
    tokens: list[Token] = []
    match = _TOKEN.match
    at = 0
    while (found := match(text, at)) is not None:
        kind = found.lastgroup or ""
        if kind == "s":
            prefix = found["prefix"]
            tokens.append(("s", prefix.lower() + " " + found["s"][len(prefix) :]))
        else:
            tokens.append((kind, found[kind]))
        at = found.end()
    if _WS.match(text, at).end() != len(text):  # type: ignore[union-attr]
        raise NotACallError(f"no Python token at {at}")
    tokens.append(_END)
    return tokens


class _Reader:
    """One call's tokens read left to right; every method leaves ``at`` after what it read."""

    __slots__ = ("at", "repeated", "tokens")

    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.at = 0
        self.repeated = 0

    def call(self) -> tuple[str, dict[str, Any]]:
        parts = [self._identifier()]
        while self._take("."):
            parts.append(self._identifier())
        self._expect("(")
        arguments: dict[str, Any] = {}
        while not self._take(")"):
            key = self._identifier()
            self._expect("=")
            if self.tokens[self.at] == ("p", "="):  # a comparison
                raise NotACallError(key)
            self.repeated += key in arguments
            arguments[key] = self._value(1)[0]  # depth 1: the call's parentheses
            if not self._take(","):
                self._expect(")")
                break
        if self.tokens[self.at] != _END:
            raise NotACallError("text after the call")
        return ".".join(parts), arguments

    # -- tokens ----------------------------------------------------------------------------------

    def _take(self, punctuation: str) -> bool:
        if self.tokens[self.at] == ("p", punctuation):
            self.at += 1
            return True
        return False

    def _expect(self, punctuation: str) -> None:
        if not self._take(punctuation):
            raise NotACallError(f"{punctuation!r} expected at token {self.at}")

    def _identifier(self) -> str:
        kind, text = self.tokens[self.at]
        if kind != "w":
            raise NotACallError(f"a name expected at token {self.at}")
        self.at += 1
        name = text if text.isascii() else unicodedata.normalize("NFKC", text)  # as Python reads names
        if not name.isidentifier() or keyword.iskeyword(name):
            raise NotACallError(name)
        return name

    # -- values: (value, whether it is a constant: a dict key may only be one) -------------------

    def _value(self, depth: int) -> tuple[Any, bool]:
        kind, text = token = self.tokens[self.at]
        self.at += 1
        if kind == "s":
            return self._strings(text)
        if kind == "i":
            return _int(text), True
        if kind == "f":
            return _float(text), True
        if kind == "w" and text in _NAMES:
            return _NAMES[text], True
        if kind == "w" and text in _JSON_NAMES:
            return _JSON_NAMES[text], False
        if kind == "p" and text in _OPEN:
            if depth >= MAX_NESTING:
                raise NotACallError("nested too deep")
            return self._container(text, depth + 1)
        if token in _SIGNS:
            return self._signed(text, depth), False
        raise NotACallError(f"a literal expected at token {self.at - 1}")

    def _container(self, opener: str, depth: int) -> tuple[Any, bool]:
        """After its opener: ``[]``, ``()``, ``{}``, a value in parentheses, a dict, or items."""
        closer = _OPEN[opener]
        if self._take(closer):
            return {} if opener == "{" else [], False
        first, constant = self._value(depth)
        if opener == "(" and self._take(")"):  # parentheses around one value: that value
            return first, constant
        if opener == "{" and self._take(":"):
            return self._dict(first, constant, depth), False
        items = [first]  # a list, a tuple or a set: a JSON array, in the order written
        while self._take(","):
            if self._take(closer):
                return items, False
            items.append(self._value(depth)[0])
        self._expect(closer)
        return items, False

    def _dict(self, key: Any, constant: bool, depth: int) -> dict[Any, Any]:
        """After its first key and ``:``."""
        found: dict[Any, Any] = {}
        while True:
            if not constant:
                raise NotACallError("a dict key that is no literal")
            found[key] = self._value(depth)[0]  # a key written twice: its first place, the later value
            if not self._take(","):
                self._expect("}")
                return found
            if self._take("}"):
                return found
            key, constant = self._value(depth)
            self._expect(":")

    def _signed(self, sign: str, depth: int) -> int | float:
        """After a first ``+`` or ``-``: more signs, then a number (signs are a loop, not nesting)."""
        negative = sign == "-"
        while (token := self.tokens[self.at]) in _SIGNS:
            negative ^= token[1] == "-"
            self.at += 1
        value, _ = self._value(depth)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise NotACallError("a sign before no number")
        return -value if negative else value

    def _strings(self, first: str) -> tuple[str, bool]:
        """Adjacent string literals, joined; an f-string makes the result no constant."""
        literals = [first]
        while self.tokens[self.at][0] == "s":
            literals.append(self.tokens[self.at][1])
            self.at += 1
        constant = True
        pieces: list[str] = []
        for literal in literals:
            prefix, _, quoted = literal.partition(" ")
            quote = 3 if quoted[:3] in ('"""', "'''") else 1
            body = quoted[quote:-quote]
            if "b" in prefix:
                raise NotACallError("bytes")
            if "f" in prefix:
                if "{" in body or "}" in body:
                    raise NotACallError("an f-string with replacement fields")
                constant = False
            pieces.append(body if "r" in prefix else _unescape(body))
        return "".join(pieces), constant


def _int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError as exc:  # more digits than Python converts (4,300)
        raise NotACallError(str(exc)) from exc


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise NotACallError("a number JSON cannot hold")
    return value


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
