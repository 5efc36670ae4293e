"""Answer parsers stay linear in the output (issue 20, row 9): streaming any amount of whitespace, text
or structure, a parser keeps a bounded state (Hermes also the whitespace it must release if text
follows, compactly) and makes no copy that grows with the answer.

Structural, not timed: ``tracemalloc`` measures what the parser keeps between feeds (its retained
state may not grow with the number of ids streamed) and the largest allocation alive during any one
feed (no copy of a buffer that grows with the answer). Per-token work beyond O(the token) needs one
or the other: a rescan of held text needs the text held; a re-join needs the copy.
"""

from __future__ import annotations

import functools
import gc
import itertools
import tracemalloc
from collections.abc import Callable
from functools import cache
from typing import SupportsIndex

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids
from test_parsing_streams import K3, QWEN, tokenizer

from dynamo_prep.parsing import (
    AnswerParser,
    HermesAnswerParser,
    KimiK3AnswerParser,
    ParseOptions,
    PlainAnswerParser,
    parser_for,
)
from dynamo_prep.parsing._answer import DeltaList, ToolCallDelta
from dynamo_prep.parsing._halves import ToolHalf
from dynamo_prep.parsing._recoveries import Recoveries
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.parsing.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, TOOL_SEP, DeepSeekV31Tools
from dynamo_prep.parsing.qwen3_coder import Qwen3CoderTools
from dynamo_prep.tokenizer import Tokenizer

HF_FAMILIES = {"harmony": "gpt_oss", "kimi_k2": "kimi_k2", "glm45": "glm45"}
WARM_IDS = 10_000
"""Streamed before the measure: the allocator's free lists and the tokenizer's caches fill up."""
STREAMED_IDS = 40_000
STATE_SLACK = 16_384
"""Bytes the retained state may vary by (allocator free lists); the old K3 parser kept ~42 KB more here."""
HELD_BYTES_PER_CHAR = 2
"""What Hermes may keep per whitespace character it holds (it is released if text follows)."""
FEED_SLACK = 8_192
"""Bytes one feed of one id may allocate at its peak above what the parser held before it, plus half
of what its state grew by (a buffer that must grow reallocates now and then); the old Hermes parser
copied all it held, on every feed."""


def k3_ids(*parts: tuple[str, bool]) -> list[int]:
    return tokenizer(K3).encode_segments(list(parts))


def k3_tag(tag: str, attrs: str = "", *, close: bool = False) -> list[tuple[str, bool]]:
    return [("<|close|>" if close else "<|open|>", True), (tag + attrs, False), ("<|sep|>", True)]


def k3(form: str) -> Callable[[], AnswerParser]:
    vocab = vocab_of(tokenizer(K3))
    if form == "hosted":
        return lambda: KimiK3AnswerParser(
            vocab, thinking=False, prompt_form="hosted", call_ids=counting_ids()
        )
    return lambda: KimiK3AnswerParser(vocab, thinking=True, call_ids=counting_ids())


def hermes() -> AnswerParser:
    vocab = vocab_of(tokenizer(QWEN))
    return HermesAnswerParser(
        vocab, think_tags=True, start_in_reasoning=False, tool_calls=True, call_ids=counting_ids()
    )


def llama3_json() -> AnswerParser:
    """Llama 3 JSON calls (the qwen-vl-demo vocabulary: the JSON is the same, the python tag text)."""
    return parser_for(vocab_of(tokenizer(QWEN)), None, "llama3_json", ParseOptions(call_ids=counting_ids()))


DEEPSEEK, QWEN3 = str(built_models()["deepseek_v3"]), str(built_models()["qwen3"])
"""Real vocabularies (tests/support/hf_models directories; ``tokenizer`` takes their paths too)."""


def composed(model: str, reasoning: str | None, tools: str) -> Callable[[], AnswerParser]:
    vocab = vocab_of(tokenizer(model))
    return lambda: parser_for(vocab, reasoning, tools, ParseOptions(call_ids=counting_ids()))


def with_markers(model: str, *parts: str) -> list[int]:
    """The parts, each one id where the vocabulary has it as a token, text otherwise."""
    tok = tokenizer(model)
    return tok.encode_segments([(part, part in tok.added_tokens) for part in parts])


def pythonic(name: str) -> Callable[[], AnswerParser]:
    """Pythonic calls (the qwen-vl-demo vocabulary: Llama 4's python tags are text, looked for)."""
    return lambda: parser_for(vocab_of(tokenizer(QWEN)), None, name, ParseOptions(call_ids=counting_ids()))


@functools.cache
def mistral_tokenizer() -> Tokenizer:
    """Mistral Small 3.2's vocabulary: [TOOL_CALLS], [ARGS], [THINK], [/THINK] are control tokens."""
    return Tokenizer.from_model_dir(built_models()["mistral_small_3"])


def mistral() -> AnswerParser:
    options = ParseOptions(call_ids=counting_ids())
    return parser_for(vocab_of(mistral_tokenizer()), "mistral", "mistral", options)


def mistral_ids(*parts: str) -> list[int]:
    """Text, and Mistral's control tokens (``[X]``) as their ids."""
    tok = mistral_tokenizer()
    return tok.encode_segments([(part, tok.is_special_token(part)) for part in parts])


def plain() -> AnswerParser:
    return PlainAnswerParser(vocab_of(tokenizer(QWEN)))


@cache
def hf(name: str) -> Tokenizer:
    return Tokenizer.from_model_dir(built_models()[name])


def declared(name: str, reasoning: str | None, tool_calls: str | None) -> Callable[[], AnswerParser]:
    """A registered parser on a tests/support/hf_models directory's vocabulary."""
    return lambda: parser_for(
        vocab_of(hf(name)), reasoning, tool_calls, ParseOptions(call_ids=counting_ids())
    )


def marked(name: str, *parts: str) -> list[int]:
    """Text with the family's markers (``<|...|>`` or ``<...>`` parts that are one token) as their ids."""
    tok = hf(name)
    return tok.encode_segments([(part, tok.is_special_token(part)) for part in parts if part])


harmony = declared("gpt_oss", "openai_gptoss", "openai")
kimi_k2 = declared("kimi_k2", None, "kimi_k2")
glm45 = declared("glm45", "glm45", "glm45")
HARMONY_CALL = marked(
    "gpt_oss",
    "<|start|>",
    "assistant",
    "<|channel|>",
    "commentary to=functions.f",
    "<|message|>",
    '{"a": 1}',
    "<|call|>",
)
K2_CALL = marked(
    "kimi_k2",
    "<|tool_call_begin|>",
    "functions.f:0",
    "<|tool_call_argument_begin|>",
    '{"a": 1}',
    "<|tool_call_end|>",
)
GLM_CALL = marked(
    "glm45",
    "<tool_call>",
    "f\n",
    "<arg_key>",
    "a",
    "</arg_key>",
    "<arg_value>",
    "1",
    "</arg_value>",
    "</tool_call>",
    "\n",
)


def blank(model: str) -> list[int]:
    return tokenizer(model).encode(" ") + tokenizer(model).encode("\n")


def words(model: str) -> list[int]:
    return tokenizer(model).encode("the quick brown fox jumps over the lazy dog. ")


def hf_words(name: str) -> list[int]:
    return hf(name).encode("the quick brown fox jumps over the lazy dog. ")


def hf_blank(name: str) -> list[int]:
    return hf(name).encode(" ") + hf(name).encode("\n")


K3_CALL = k3_ids(
    *k3_tag("call", ' tool="f"'),
    *k3_tag("argument", ' key="a" type="integer"'),
    ("1", False),
    *k3_tag("argument", close=True),
    *k3_tag("call", close=True),
)
HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
LLAMA_CALL = '{"name": "f", "parameters": {"a": 1, "s": "x \\" } y"}}; '
PYTHON_CALL = "f(a=1, s='x \\' ) y', n=[None, {'k': True}]), "
THINK_CLOSED = k3_ids(("hm", False), *k3_tag("think", close=True))
DEEPSEEK_CALL = (CALL_BEGIN, "f", TOOL_SEP, '{"a": 1, "s": "x \\" } y"}', CALL_END)
DEEPSEEK_V3_CALL = (CALL_BEGIN, "function", TOOL_SEP, 'f\n```json\n{"a": [1, "}"]}\n```', CALL_END)
CODER_CALL = (
    "<tool_call>",
    "\n<function=f>\n<parameter=a>\n1 < 2 > 0\n</parameter>\n</function>\n",
    "</tool_call>",
)

CASES = {
    # (parser, ids before the stream, ids streamed over and over, whether it holds the whitespace)
    "k3 after think, whitespace": (k3("reference"), THINK_CLOSED, blank(K3), False),
    "k3 hosted, whitespace": (k3("hosted"), [], blank(K3), False),
    "k3 hosted, text outside a channel": (k3("hosted"), words(K3), blank(K3) + words(K3), False),
    "k3, text": (k3("reference"), [], words(K3), False),
    "k3, tool calls": (k3("hosted"), k3_ids(*k3_tag("tools")), K3_CALL, False),
    "hermes, whitespace at the start": (hermes, [], blank(QWEN), True),
    "hermes, whitespace after a call": (hermes, tokenizer(QWEN).encode(HERMES_CALL), blank(QWEN), True),
    "hermes, a partial tag then whitespace": (
        hermes,
        tokenizer(QWEN).encode(HERMES_CALL + "<"),
        blank(QWEN),
        False,
    ),
    "hermes, text": (hermes, [], words(QWEN), False),
    "hermes, tool calls": (hermes, [], tokenizer(QWEN).encode(HERMES_CALL), False),
    "llama3_json, whitespace at the start": (llama3_json, [], blank(QWEN), True),
    "llama3_json, whitespace after a call": (
        llama3_json,
        tokenizer(QWEN).encode(LLAMA_CALL),
        blank(QWEN),
        True,
    ),
    "llama3_json, text": (llama3_json, [], words(QWEN), False),
    "llama3_json, tool calls": (llama3_json, [], tokenizer(QWEN).encode(LLAMA_CALL), False),
    "deepseek_v31, whitespace between calls": (
        composed(DEEPSEEK, None, "deepseek_v31"),
        with_markers(DEEPSEEK, CALLS_BEGIN, *DEEPSEEK_CALL),
        blank(DEEPSEEK),
        True,
    ),
    "deepseek_v31, tool calls": (
        composed(DEEPSEEK, None, "deepseek_v31"),
        with_markers(DEEPSEEK, CALLS_BEGIN),
        with_markers(DEEPSEEK, *DEEPSEEK_CALL),
        False,
    ),
    "deepseek_v3, tool calls": (
        composed(DEEPSEEK, None, "deepseek_v3"),
        with_markers(DEEPSEEK, CALLS_BEGIN),
        with_markers(DEEPSEEK, *DEEPSEEK_V3_CALL),
        False,
    ),
    "deepseek_v3 reasoning off, text": (
        composed(DEEPSEEK, "deepseek_v3", "deepseek_v31"),
        [],
        words(DEEPSEEK),
        False,
    ),
    "deepseek_v31, markers in text": (
        composed(QWEN, None, "deepseek_v31"),
        with_markers(QWEN, CALLS_BEGIN),
        with_markers(QWEN, *DEEPSEEK_CALL),
        False,
    ),
    "qwen3_coder, tool calls": (
        composed(QWEN3, None, "qwen3_coder"),
        [],
        with_markers(QWEN3, *CODER_CALL),
        False,
    ),
    "qwen3_coder, whitespace after a call": (
        composed(QWEN3, None, "qwen3_coder"),
        with_markers(QWEN3, *CODER_CALL),
        blank(QWEN3),
        True,
    ),
    "qwen3_coder, text and tags in text": (
        composed(QWEN, None, "qwen3_coder"),
        [],
        words(QWEN) + with_markers(QWEN, *CODER_CALL),
        False,
    ),
    "pythonic, whitespace at the start": (pythonic("pythonic"), [], blank(QWEN), True),
    "pythonic, whitespace after the list": (
        pythonic("pythonic"),
        tokenizer(QWEN).encode(f"[{PYTHON_CALL}]"),
        blank(QWEN),
        True,
    ),
    "pythonic, text": (pythonic("pythonic"), [], words(QWEN), False),
    "pythonic, tool calls": (
        pythonic("pythonic"),
        tokenizer(QWEN).encode("["),
        tokenizer(QWEN).encode(PYTHON_CALL),
        False,
    ),
    "pythonic, brackets in a call": (
        pythonic("pythonic"),
        tokenizer(QWEN).encode("[f(a="),
        tokenizer(QWEN).encode("[[[(({{"),
        False,
    ),
    "llama4_pythonic, tool calls": (
        pythonic("llama4_pythonic"),
        tokenizer(QWEN).encode("<|python_start|>["),
        tokenizer(QWEN).encode(PYTHON_CALL),
        False,
    ),
    "llama4_pythonic, brackets": (pythonic("llama4_pythonic"), [], tokenizer(QWEN).encode("[[[(({{"), False),
    "plain, whitespace": (plain, [], blank(QWEN), False),
    "harmony, text": (
        harmony,
        marked("gpt_oss", "<|channel|>", "final", "<|message|>"),
        hf_words("gpt_oss"),
        False,
    ),
    "harmony, whitespace between messages": (harmony, HARMONY_CALL, hf_blank("gpt_oss"), False),
    "harmony, text without a header": (harmony, [], hf_words("gpt_oss"), False),
    "harmony, tool calls": (harmony, [], HARMONY_CALL, False),
    "kimi_k2, whitespace at the start": (kimi_k2, [], hf_blank("kimi_k2"), True),
    "kimi_k2, text": (kimi_k2, [], hf_words("kimi_k2"), False),
    "kimi_k2, tool calls": (kimi_k2, marked("kimi_k2", "<|tool_calls_section_begin|>"), K2_CALL, False),
    "glm45, whitespace after a call": (glm45, GLM_CALL, hf_blank("glm45"), True),
    "glm45, text": (glm45, [], hf_words("glm45"), False),
    "glm45, tool calls": (glm45, [], GLM_CALL, False),
    "harmony, a long call body": (harmony, HARMONY_CALL[:-1], hf("gpt_oss").encode('"ab c'), True),
    "kimi_k2, long arguments": (kimi_k2, K2_CALL[:-2], hf("kimi_k2").encode('"ab c'), True),
    "glm45, a long value": (glm45, GLM_CALL[:7], hf("glm45").encode("ab c "), True),
}
MISTRAL_CALL = ("[TOOL_CALLS]", "f", "[ARGS]", '{"a": 1, "s": "x \\" } y"}')
MISTRAL_ARRAY = ("[TOOL_CALLS]", '[{"name": "f", "arguments": {"a": [1, "]"]}}]')
MISTRAL_CASES = {
    "mistral, whitespace after a call": (
        lambda: mistral_ids(*MISTRAL_CALL),
        lambda: mistral_ids(" ", "\n"),
        True,
    ),
    "mistral, text": (list, lambda: mistral_ids("the quick brown fox jumps over the lazy dog. "), False),
    "mistral, reasoning": (
        lambda: mistral_ids("[THINK]"),
        lambda: mistral_ids("the quick brown fox. "),
        False,
    ),
    "mistral, tool calls": (list, lambda: mistral_ids(*MISTRAL_CALL, " "), False),
    "mistral, JSON array calls": (list, lambda: mistral_ids(*MISTRAL_ARRAY), False),
    "mistral, markers that open no call": (
        list,
        lambda: mistral_ids("[TOOL_CALLS]", "x ", "[ARGS]", "[THINK]"),
        False,
    ),
}
"""Mistral's cases, built when run (a 131k-token vocabulary: loaded once, only by these)."""


class Streamer:
    """One parser fed ``body`` over and over, one id per feed, under ``tracemalloc``."""

    def __init__(self, make: Callable[[], AnswerParser], prefix: list[int], body: list[int]) -> None:
        self.parser = make()
        self.parser.feed(prefix)
        self.ids = itertools.cycle(body)

    def run(self, count: int) -> int:
        """Feeds ``count`` ids; returns the most any one feed allocated above what was held before it."""
        worst = 0
        for _ in range(count):
            token_id = next(self.ids)
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            self.parser.feed((token_id,))
            worst = max(worst, tracemalloc.get_traced_memory()[1] - held)
        return worst


def retained() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def case_parts(case: str) -> tuple[Callable[[], AnswerParser], list[int], list[int], bool]:
    if case in MISTRAL_CASES:
        prefix, body, holds = MISTRAL_CASES[case]
        return mistral, prefix(), body(), holds
    return CASES[case]


@pytest.mark.parametrize("case", [*CASES, *MISTRAL_CASES])
def test_streaming_keeps_a_bounded_state_and_makes_no_growing_copy(case: str) -> None:
    make, prefix, body, holds = case_parts(case)
    allowed = STATE_SLACK + (HELD_BYTES_PER_CHAR * STREAMED_IDS if holds else 0)  # one char per id
    tracemalloc.start()
    try:
        streamer = Streamer(make, prefix, body)
        streamer.run(WARM_IDS)
        before = retained()
        worst = streamer.run(STREAMED_IDS)
        grown = retained() - before
    finally:
        tracemalloc.stop()
    assert grown <= allowed, f"the parser's state grew by {grown} bytes"
    assert worst <= FEED_SLACK + max(grown, 0) // 2, f"a feed of one id allocated {worst} bytes at its peak"


@pytest.mark.parametrize("case", [*CASES, *MISTRAL_CASES])
def test_long_runs_parse_the_same_whole_and_streamed(case: str) -> None:
    """Held whitespace is released, or dropped, exactly as before it was set aside."""
    make, prefix, body, _ = case_parts(case)
    family = case.split(",", maxsplit=1)[0]
    if case in MISTRAL_CASES:
        tail = mistral_ids("the end.")
    else:
        tail = hf_words(HF_FAMILIES[family]) if family in HF_FAMILIES else words(K3 if "k3" in case else QWEN)
    ids = prefix + body * (2_000 // len(body) + 1) + tail
    all_ways(make, ids)


class CountingText(str):
    """Text that counts the characters its ``find`` calls look at."""

    looked = 0

    def find(self, sub: str, start: SupportsIndex | None = None, end: SupportsIndex | None = None) -> int:
        where = super().find(sub, start, end)
        begin = 0 if start is None else int(start)
        CountingText.looked += (where if where >= 0 else len(self) if end is None else int(end)) - begin
        return where


@pytest.mark.parametrize("tools", [DeepSeekV31Tools, Qwen3CoderTools])
def test_markers_in_text_are_searched_in_one_pass_whatever_never_comes(tools: type[ToolHalf]) -> None:
    """A whole answer of many calls (markers in text) where a valid marker never comes (the calls
    section's end): each marker is searched forward once, not again from every call."""
    one = "".join(DEEPSEEK_CALL) if tools is DeepSeekV31Tools else "".join(CODER_CALL) + "\n"
    text = CountingText((CALLS_BEGIN if tools is DeepSeekV31Tools else "") + one * 2_000)
    half = tools(ParseOptions(call_ids=counting_ids()), frozenset(tools.MARKERS), Recoveries())
    out = DeltaList()
    CountingText.looked = 0
    half.text(text, out)
    assert sum(isinstance(delta, ToolCallDelta) for delta in out.done()) == 2_000
    assert CountingText.looked <= 2 * len(tools.MARKERS) * len(text)
