"""Fuzz targets for hostile input: the tokenizer's long-run split, stop strings, chat templates.

Shared, like ``strategies.py``, by ``tests/test_hostile_fuzz.py`` (a seeded slice) and
``benchmarks/fuzz.py`` (>= 10,000 cases per target, merged into its targets). The oracles live here:
``reference_split`` (Kimi's splitter, character by character) and ``NaiveStops`` (every stop
string searched in the whole held text on every push).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from strategies import K3, Outcome, _classify, preprocessor, tokenizer

from dynamo_prep.formatter.jinja import ChatTemplateError, JinjaFormatter, TemplateLimits
from dynamo_prep.frontend.stops import StopMatcher
from dynamo_prep.preprocessor import MAX_STOP_CHARS, MAX_STOP_STRINGS, PreprocessError
from dynamo_prep.prompt import PromptRenderError
from dynamo_prep.tokenizer import MAX_ENCODE_CHARS, MAX_RUN_CHARS, split_for_encoding

# ============================================================================ oracles


def reference_split(s: str, limit: int) -> Iterator[str]:
    """Kimi's ``_split_whitespaces_or_nonwhitespaces``, character by character."""
    run_len = 0
    run_is_space = s[0].isspace() if s else False
    start = 0
    for i, char in enumerate(s):
        is_space = char.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > limit:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


def reference_pieces(text: str, window: int, limit: int) -> list[str]:
    """Kimi's ``_encode_text_piece`` split: windows first, then each window's runs."""
    return [
        piece
        for start in range(0, len(text), window)
        for piece in reference_split(text[start : start + window], limit)
    ]


class NaiveStops:
    """The stop-string rule of the answer layer, as plainly as possible (the matcher it replaced)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        held = self.held = self.held + text
        found = [held.find(stop) for stop in self.stops if stop in held]
        if found:
            self.stopped, self.held = True, ""
            return held[: min(found)], True
        keep = max((self._overlap(held, stop) for stop in self.stops), default=0)
        self.held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def finish(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0


def run_stops(matcher: StopMatcher | NaiveStops, chunks: Sequence[str]) -> list[tuple[str, bool] | str]:
    outputs: list[tuple[str, bool] | str] = [matcher.push(chunk) for chunk in chunks]
    outputs.append(matcher.finish())
    return outputs


# ============================================================================ tokenizer split


@dataclass(frozen=True)
class SplitInput:
    """Runs of one character each; ``real`` uses Kimi's limits (run lengths near 25,000)."""

    runs: tuple[tuple[str, int], ...]
    window: int
    max_run: int
    real: bool

    def text(self) -> str:
        return "".join(char * count for char, count in self.runs)


_RUN_CHARS = " \t\n\x1f\x85\u3000a.é你"
_REAL_LENGTHS = (
    1,
    2,
    MAX_RUN_CHARS - 1,
    MAX_RUN_CHARS,
    MAX_RUN_CHARS + 1,
    2 * MAX_RUN_CHARS,
    2 * MAX_RUN_CHARS + 1,
)

split_inputs = st.one_of(
    st.builds(
        SplitInput,
        runs=st.lists(st.tuples(st.sampled_from(_RUN_CHARS), st.integers(1, 40)), max_size=10).map(tuple),
        window=st.integers(1, 120),
        max_run=st.integers(1, 12),
        real=st.just(False),
    ),
    st.builds(
        SplitInput,
        runs=st.lists(st.tuples(st.sampled_from(_RUN_CHARS), st.sampled_from(_REAL_LENGTHS)), max_size=4).map(
            tuple
        ),
        window=st.just(MAX_ENCODE_CHARS),
        max_run=st.just(MAX_RUN_CHARS),
        real=st.just(True),
    ),
)


def check_split(data: SplitInput) -> Outcome:
    """The linear split cuts exactly where the reference does; at Kimi's limits the ids agree too."""
    text = data.text()
    pieces = list(split_for_encoding(text, window=data.window, max_run=data.max_run))
    assert pieces == reference_pieces(text, data.window, data.max_run)
    if data.real:
        k3 = tokenizer(K3)
        expected = [
            i for piece in reference_pieces(text, data.window, data.max_run) for i in k3.encode(piece)
        ]
        assert k3.encode(text) == expected
    return "ok"


# ============================================================================ stop strings


@dataclass(frozen=True)
class StopInput:
    """A request's stop strings (sometimes past the limits) and the text a worker streams back."""

    stops: tuple[str, ...]
    chunks: tuple[str, ...]


_STOP_TEXT = st.text(alphabet="ab\n<|>", max_size=6)
stop_inputs = st.builds(
    StopInput,
    stops=st.one_of(
        st.lists(_STOP_TEXT, max_size=8),
        st.lists(_STOP_TEXT, min_size=MAX_STOP_STRINGS - 1, max_size=MAX_STOP_STRINGS + 2),
        st.lists(st.sampled_from(["a" * (MAX_STOP_CHARS + 1), "b" * MAX_STOP_CHARS, "ab"]), max_size=3),
    ).map(tuple),
    chunks=st.lists(st.text(alphabet="ab\n<|>c", max_size=10), max_size=10).map(tuple),
)


def check_stops(data: StopInput) -> Outcome:
    """The preprocessor refuses exactly the stop lists past its limits; the matcher equals the oracle."""
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": list(data.stops)}
    within = len(data.stops) <= MAX_STOP_STRINGS and all(
        0 < len(stop) <= MAX_STOP_CHARS for stop in data.stops
    )
    try:
        preprocessor(K3).preprocess(request)
    except PreprocessError as exc:
        assert not within, f"refused a valid stop list: {exc}"
        assert exc.param == "stop"
        return "rejected:PreprocessError"
    assert within, "accepted a stop list past the limits"
    assert run_stops(StopMatcher(data.stops), data.chunks) == run_stops(NaiveStops(data.stops), data.chunks)
    return "ok"


# ============================================================================ chat templates

FUZZ_LIMITS = TemplateLimits(seconds=0.25, max_chars=1 << 20, max_total_chars=1 << 22)
_MESSAGES = [{"role": "user", "content": "hi\tthere"}, {"role": "assistant", "content": "ok"}]


@dataclass(frozen=True)
class TemplateInput:
    """A template built from hostile pieces; ``small`` when every number in it is at most 100, so a
    plain Jinja sandbox (which folds constants at compile time, unbounded) can render it too."""

    source: str
    small: bool


def _numbers(big: bool) -> st.SearchStrategy[int]:
    small = st.sampled_from([0, 1, 2, 3, 7, 10, 64, 100])
    return st.one_of(small, st.sampled_from([1000, 100_000, 10**7, 10**9, -(10**8)])) if big else small


def _expressions(big: bool) -> st.SearchStrategy[str]:
    numbers = _numbers(big).map(str)
    atoms = st.one_of(
        numbers,
        st.sampled_from(["'x'", "'ab'", "'\\t'", "messages[0].content", "[1, 2]", "ns.s", "i"]),
    )

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, st.sampled_from(["*", "**", "~", "+", "%"]), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"
            ),
            st.tuples(inner, numbers).map(lambda t: f"({t[0]}|string).center({t[1]})"),
            st.tuples(inner, numbers).map(lambda t: f"({t[0]}|string|center({t[1]}))"),
            st.tuples(inner, numbers).map(lambda t: f"('{{:>{t[1]}}}'.format({t[0]}))"),
            st.tuples(inner, numbers).map(lambda t: f"([{t[0]}]|batch({t[1]}, 'y')|list|length)"),
            inner.map(lambda e: f"({e}|string).replace('', '--')"),
            inner.map(lambda e: f"([{e}, {e}, {e}]|join)"),
            inner.map(lambda e: f"({e}|length)"),
        )

    return st.recursive(atoms, grow, max_leaves=4)


def _statements(big: bool) -> st.SearchStrategy[str]:
    expressions = _expressions(big)
    leaf = st.one_of(
        expressions.map(lambda e: "{{ " + e + " }}"),
        expressions.map(lambda e: "{% set ns.s = ns.s ~ " + e + " %}"),
    )

    def loops(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.tuples(_numbers(big), st.lists(inner, min_size=1, max_size=3)).map(
            lambda t: "{% for i in range(" + str(t[0]) + ") %}" + "".join(t[1]) + "{% endfor %}"
        )

    return st.recursive(leaf, loops, max_leaves=5)


template_inputs = st.one_of(
    st.lists(_statements(False), min_size=1, max_size=4).map(
        lambda parts: TemplateInput(
            "{% set ns = namespace(s='', i=0) %}" + "".join(parts) + "{{ ns.s }}", True
        )
    ),
    st.lists(_statements(True), min_size=1, max_size=4).map(
        lambda parts: TemplateInput(
            "{% set ns = namespace(s='', i=0) %}" + "".join(parts) + "{{ ns.s }}", False
        )
    ),
)

_PLAIN = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)


def check_template(data: TemplateInput) -> Outcome:
    """Compile and render either succeed within the limits or raise the documented errors (never
    hang, never another exception); a small template renders exactly as a plain Jinja sandbox does."""
    try:
        formatter = JinjaFormatter.from_template(data.source, limits=FUZZ_LIMITS)
        text = formatter.render_text(_MESSAGES)
    except Exception as exc:
        return _classify(exc, (PromptRenderError, ChatTemplateError))
    assert len(text) <= FUZZ_LIMITS.max_chars
    if data.small:
        assert text == _plain_render(data.source), "differs from a plain Jinja sandbox"
    return "ok"


def _plain_render(source: str) -> str:
    template = _PLAIN.from_string(source)
    return template.render(messages=_MESSAGES, tools=None, documents=None, add_generation_prompt=False)


TARGETS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], Outcome]]] = {
    "tokenizer_split": (split_inputs, check_split),
    "stop_strings": (stop_inputs, check_stops),
    "chat_template": (template_inputs, check_template),
}
