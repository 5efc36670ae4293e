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

import pytest
from support.hf_models import built_models
from test_parsing_streams import K3, QWEN, all_ways, counting_ids, tokenizer

from dynamo_prep.parsing import (
    AnswerParser,
    HermesAnswerParser,
    KimiK3AnswerParser,
    ParseOptions,
    PlainAnswerParser,
    parser_for,
)
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.tokenizer import Tokenizer

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


def blank(model: str) -> list[int]:
    return tokenizer(model).encode(" ") + tokenizer(model).encode("\n")


def words(model: str) -> list[int]:
    return tokenizer(model).encode("the quick brown fox jumps over the lazy dog. ")


K3_CALL = k3_ids(
    *k3_tag("call", ' tool="f"'),
    *k3_tag("argument", ' key="a" type="integer"'),
    ("1", False),
    *k3_tag("argument", close=True),
    *k3_tag("call", close=True),
)
HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
LLAMA_CALL = '{"name": "f", "parameters": {"a": 1, "s": "x \\" } y"}}; '
THINK_CLOSED = k3_ids(("hm", False), *k3_tag("think", close=True))

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
    "plain, whitespace": (plain, [], blank(QWEN), False),
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
    model = K3 if "k3" in case else QWEN
    tail = mistral_ids("the end.") if case in MISTRAL_CASES else words(model)
    ids = prefix + body * (2_000 // len(body) + 1) + tail
    all_ways(make, ids)
