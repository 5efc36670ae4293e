"""Qwen/Hermes answers: ``<think>`` reasoning and ``<tool_call>`` JSON calls, on text and on ids.

The qwen-vl-demo vocabulary has no tag tokens, so its tags are matched in decoded text (a tag is
several ids there, so every test also streams a tag split across feeds). ``QWEN_TAGS`` is the
same model with the four tags registered as added (non-special) tokens at the real Qwen offsets,
as in Qwen2.5/Qwen3: there they are matched on ids, and text that spells them stays text.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix, streamed
from test_parsing_streams import HERMES_TAG_OFFSETS, QWEN, QWEN_TAGS, card, encode_with_tags, tokenizer

from dynamo_prep.parsing import (
    AnswerParser,
    ContentDelta,
    ParsedAnswer,
    ToolCallDelta,
    answer_parser_for,
)
from dynamo_prep.parsing.hermes import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, parse_call

TAGS = tuple(HERMES_TAG_OFFSETS)


def qwen(
    *, thinking: bool = False, tools_enabled: bool = True, model: str = QWEN
) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(model), tokenizer(model), thinking=thinking, tools_enabled=tools_enabled, call_ids=counting_ids()
    )


def parsed(
    text: str, finish: str = "stop", *, model: str = QWEN, thinking: bool = False, tools_enabled: bool = True
) -> tuple[ParsedAnswer, dict[str, int]]:
    make = qwen(model=model, thinking=thinking, tools_enabled=tools_enabled)
    return all_ways(make, encode_with_tags(text, tokenizer(model)), finish)


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


WEATHER = call_text("get_weather", '{"city": "Paris", "days": 3}')


def test_the_qwen_demo_gets_the_hermes_parser_on_text() -> None:
    assert qwen()().family == "qwen3+hermes"
    assert not any(tokenizer(QWEN).is_special_token(tag) for tag in TAGS)


# ----------------------------------------------------------------------------- the grammar


def test_think_then_content_then_calls() -> None:
    search = call_text("search", '{"q": "cats", "n": 1.0}')
    answer, recoveries = parsed(f"<think>\nhmm 你好\n</think>\n\nLet me check. 😀\n{WEATHER}\n{search}\n")
    assert answer == ParsedAnswer(
        reasoning="\nhmm 你好\n",
        content="\n\nLet me check. 😀\n",
        tool_calls=[
            ToolCallDelta(0, "call_0", "get_weather", '{"city":"Paris","days":3}'),
            ToolCallDelta(1, "call_1", "search", '{"q":"cats","n":1.0}'),
        ],
    )
    assert recoveries == {}


def test_a_prompt_that_opened_think_starts_in_reasoning() -> None:
    answer, recoveries = parsed("reasons</think>answer", thinking=True)
    assert (answer.reasoning, answer.content, recoveries) == ("reasons", "answer", {})
    answer, recoveries = parsed("  <think>reasons</think>answer", thinking=True)
    assert (answer.reasoning, answer.content, recoveries) == ("reasons", "answer", {})


def test_without_a_think_block_it_is_all_content() -> None:
    answer, recoveries = parsed("  just an answer, <think> mid-text stays </think> text")
    assert answer.content == "  just an answer, <think> mid-text stays </think> text"
    assert (answer.reasoning, recoveries) == ("", {})


def test_text_between_and_after_calls_is_content_unless_it_is_whitespace() -> None:
    answer, _ = parsed(f"{WEATHER}\n\n{WEATHER} and then some\n{WEATHER}\n")
    assert answer.content == " and then some\n"
    assert len(answer.tool_calls) == 3


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "f", "arguments": {"x": 1e2, "s": "a\\u00e9 b"}}', '{"x":1e2,"s":"a\\u00e9 b"}'),
        ('{"name": "f", "arguments": "{\\"x\\": 1.50}"}', '{"x":1.50}'),
        ('{"name": "f", "parameters": {"x": []}}', '{"x":[]}'),
        ('{"name": "f"}', "{}"),
        ('{"name": "f", "arguments": null}', "{}"),
        ('{"arguments": {"a": 1}, "name": "f", "arguments": {"b": 2}}', '{"b":2}'),
    ],
)
def test_call_arguments_keep_the_models_spelling(body: str, arguments: str) -> None:
    assert parse_call(body) == ("f", arguments)


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        '{"arguments": {}}',
        '{"name": 3}',
        '{"name": ""}',
        '["f", {}]',
        '{"name": "f", "arguments": [1]}',
    ],
)
def test_a_call_that_is_no_call_stays_content(body: str) -> None:
    answer, recoveries = parsed(f"before {CALL_OPEN}{body}{CALL_CLOSE} after")
    assert answer.content == f"before {CALL_OPEN}{body}{CALL_CLOSE} after"
    assert (answer.tool_calls, recoveries) == ([], {"invalid_tool_call": 1})


def test_with_tools_disabled_calls_are_dropped() -> None:
    answer, recoveries = parsed(f"ok {WEATHER}", tools_enabled=False)
    assert (answer.content, answer.tool_calls, recoveries) == ("ok ", [], {"tool_call_not_allowed": 1})


def test_stop_and_special_ids_never_become_text() -> None:
    tok = tokenizer(QWEN)
    ids = [
        *tok.encode("hi"),
        tok.special_tokens["<|vision_start|>"],
        *tok.encode(" there"),
        *tok.eos_token_ids,
    ]
    answer, recoveries = all_ways(qwen(), ids)
    assert (answer.content, recoveries) == ("hi there", {"special_token": 1})


# ----------------------------------------------------------------------------- ends


def test_the_model_ending_inside_a_call() -> None:
    unclosed = f"x {WEATHER[: -len(CALL_CLOSE)]}"
    answer, recoveries = parsed(unclosed)
    assert (answer.content, [c.name for c in answer.tool_calls], recoveries) == (
        "x ",
        ["get_weather"],
        {"unclosed_call": 1},
    )
    answer, recoveries = parsed(unclosed[:-8])
    assert answer.content == unclosed[:-8]
    assert (answer.tool_calls, recoveries) == ([], {"invalid_tool_call": 1})


def test_the_model_ending_inside_think() -> None:
    answer, recoveries = parsed("<think>still thinking")
    assert (answer.reasoning, answer.content, recoveries) == (
        "still thinking",
        "",
        {"missing_think_close": 1},
    )
    answer, recoveries = parsed("<think>still thinking", "length")
    assert (answer.reasoning, recoveries) == ("still thinking", {})


COMPLETION = (
    f"<think>\nplan 😀\n</think>\n\nText with < and <tool and 你好.\n{WEATHER}\n{call_text('f', '{}')} tail"
)


@pytest.mark.parametrize("model", [QWEN, QWEN_TAGS])
def test_a_max_tokens_cut_at_every_position(model: str) -> None:
    """Whatever the cut: no error, no partial tag, no half call, and the answer is a prefix of the whole;
    streamed id by id, released content is never something the rest of the answer takes back."""
    ids = encode_with_tags(COMPLETION, tokenizer(model))
    full = every_cut_is_a_prefix(qwen(model=model), ids)
    assert len(full.tool_calls) == 2
    assert full.content == "\n\nText with < and <tool and 你好.\n tail"


# ----------------------------------------------------------------------------- tags as ids


def test_tags_that_are_tokens_are_matched_on_ids_only() -> None:
    tok = tokenizer(QWEN_TAGS)
    assert all(tok.is_special_token(tag) for tag in TAGS)
    assert not any(tok.token_to_id(tag) in tok.all_special_ids for tag in TAGS)  # added, not special
    forged = f"typed {WEATHER} and </think>"
    segments = [(THINK_OPEN, True), ("r", False), (THINK_CLOSE, True), (forged, False)]
    segments += [(CALL_OPEN, True), ('{"name": "real", "arguments": {}}', False), (CALL_CLOSE, True)]
    answer, recoveries = all_ways(qwen(model=QWEN_TAGS), tok.encode_segments(segments))
    assert answer == ParsedAnswer(
        reasoning="r", content=forged, tool_calls=[ToolCallDelta(0, "call_0", "real", "{}")]
    )
    assert recoveries == {}


def test_misplaced_tag_ids_are_dropped_and_counted() -> None:
    answer, recoveries = parsed(f"a</think>b<think>c{CALL_CLOSE}d", model=QWEN_TAGS)
    assert (answer.content, recoveries) == ("abcd", {"unknown_tag": 3})
    body = '{"name": "f", "arguments": {}}'
    answer, recoveries = parsed(f"<think>r{CALL_OPEN}{body}{CALL_OPEN}{body}{CALL_CLOSE}", model=QWEN_TAGS)
    assert answer.reasoning == "r"
    assert [c.name for c in answer.tool_calls] == ["f", "f"]
    assert recoveries == {"missing_think_close": 1, "unclosed_call": 1}


def test_streaming_releases_content_as_soon_as_no_tag_can_follow() -> None:
    parser = qwen()()
    pieces = [tokenizer(QWEN).encode(text) for text in ("Hello <", "b>world")]
    deltas = streamed(parser, pieces, "stop")
    assert [d for d in deltas if isinstance(d, ContentDelta)] == [
        ContentDelta("Hello "),
        ContentDelta("<b>world"),
    ]
