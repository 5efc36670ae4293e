"""GPT-OSS Harmony answers (``openai`` + ``openai_gptoss``) on the gpt_oss directory's vocabulary (its
seven markers special tokens): analysis is reasoning, final and commentary preambles are content, a
message to ``functions.NAME`` is a call released whole at its end; markers are read on ids only,
and what is not a valid message stays content (or is dropped, counted), never markup."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix, marked_ids

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.parsing import (
    AnswerParser,
    ParsedAnswer,
    ToolCallDelta,
    answer_parser_for,
    parse_answer,
)
from dynamo_prep.parsing.harmony import MAX_HEADER_TOKENS, Header, parse_header
from dynamo_prep.tokenizer import Tokenizer

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(built_models()["gpt_oss"])


@cache
def card() -> ModelDeploymentCard:
    return ModelDeploymentCard.from_model_dir(built_models()["gpt_oss"])  # no flags: by model_type


def harmony(*, tools_enabled: bool = True) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(), tokenizer(), thinking=False, tools_enabled=tools_enabled, call_ids=counting_ids()
    )


def ids_of(text: str) -> list[int]:
    return marked_ids(tokenizer(), MARKERS, text)


def parsed(text: str, finish: str = "stop", **options: bool) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(harmony(**options), ids_of(text), finish)


def calls(answer: ParsedAnswer) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


ANALYSIS = f"{CHANNEL}analysis{MESSAGE}The user wants the weather 😀.{END}"
WEATHER_CALL = f"{START}assistant{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json{MESSAGE}"
WEATHER_CALL += '{"city": "Paris", "days": 2.50}' + CALL
FINAL = f"{START}assistant{CHANNEL}final{MESSAGE}Sunny, 21°C.{RETURN}"


def test_the_family_by_model_type_and_the_declared_names() -> None:
    assert card().runtime_config.tool_call_parser is None  # chosen by model_type gpt_oss, as vLLM does
    assert harmony()().family == "openai_gptoss+openai"


def test_reasoning_then_a_call() -> None:
    answer, recoveries = parsed(ANALYSIS + WEATHER_CALL)
    assert (answer.reasoning, answer.content, recoveries) == ("The user wants the weather 😀.", "", {})
    assert answer.tool_calls == [ToolCallDelta(0, "call_0", "get_weather", '{"city":"Paris","days":2.50}')]


def test_reasoning_then_the_final_answer() -> None:
    answer, recoveries = parsed(ANALYSIS + FINAL)
    assert (answer.reasoning, answer.content, answer.tool_calls, recoveries) == (
        "The user wants the weather 😀.",
        "Sunny, 21°C.",
        [],
        {},
    )


@pytest.mark.parametrize(
    "header",
    [
        f"{CHANNEL}commentary to=functions.get_weather {CONSTRAIN}json",
        f" to=functions.get_weather{CHANNEL}commentary {CONSTRAIN}json",
        f" to=functions.get_weather{CHANNEL}commentary json",
        f"{CHANNEL}commentary to=functions.get_weather",
        f"{CHANNEL}commentary to=functions.get_weather{CONSTRAIN}json",
        f"{CHANNEL}analysis to=functions.get_weather",  # a function recipient is a call on any channel
        f"{CHANNEL}commentary to=get_weather",  # a bare name is a function (vLLM's chat completions)
    ],
)
def test_every_header_form_of_a_call(header: str) -> None:
    answer, recoveries = parsed(f'{header}{MESSAGE}{{"city": "Oslo"}}{CALL}')
    assert (calls(answer), answer.content, answer.reasoning, recoveries) == (
        [("get_weather", {"city": "Oslo"})],
        "",
        "",
        {},
    )


def test_a_preamble_is_content_and_calls_follow() -> None:
    text = f"{CHANNEL}commentary{MESSAGE}Let me check.{END}{WEATHER_CALL}"
    text += f"{START}assistant{CHANNEL}commentary to=functions.search{MESSAGE}{{}}{CALL}"
    answer, recoveries = parsed(text)
    assert answer.content == "Let me check."
    assert calls(answer) == [("get_weather", {"city": "Paris", "days": 2.5}), ("search", {})]
    assert [call.index for call in answer.tool_calls] == [0, 1] and recoveries == {}


def test_messages_of_one_kind_are_joined_by_a_newline() -> None:
    text = f"{CHANNEL}analysis{MESSAGE}one{END}{START}assistant{CHANNEL}analysis{MESSAGE}two{END}"
    text += f"{START}assistant{CHANNEL}commentary{MESSAGE}pre{END}{FINAL}"
    answer, _ = parsed(text)
    assert (answer.reasoning, answer.content) == ("one\ntwo", "pre\nSunny, 21°C.")


def test_the_end_of_the_answer_ends_the_last_message() -> None:
    """``<|call|>`` and ``<|return|>`` are stop ids an engine may strip: the answer's end ends the message."""
    answer, recoveries = parsed(ANALYSIS + WEATHER_CALL.removesuffix(CALL))
    assert (calls(answer), recoveries) == ([("get_weather", {"city": "Paris", "days": 2.5})], {})
    answer, recoveries = parsed(f"{CHANNEL}final{MESSAGE}Hi")
    assert (answer.content, recoveries) == ("Hi", {})


def test_text_that_spells_markers_is_text() -> None:
    spelled = f"use {CHANNEL}final{MESSAGE} or {CALL} in text"
    ids = tokenizer().encode_segments([(CHANNEL, True), ("final", False), (MESSAGE, True), (spelled, False)])
    answer, recoveries = all_ways(harmony(), ids)
    assert (answer.content, recoveries) == (spelled, {})


def test_a_body_that_is_not_a_json_object_stays_content() -> None:
    text = f"{CHANNEL}commentary to=functions.f json{MESSAGE}not json{CALL}"
    answer, recoveries = parsed(ANALYSIS + f"{START}assistant" + text)
    assert (answer.content, answer.tool_calls, recoveries) == ("not json", [], {"invalid_tool_call": 1})
    answer, _ = parsed(f"{CHANNEL}commentary to=functions.f{MESSAGE}  {CALL}")  # no arguments: {}
    assert calls(answer) == [("f", {})]


def test_plain_text_without_harmony_is_content() -> None:
    answer, recoveries = parsed("The model wrote no header 😀")
    assert (answer.content, recoveries) == ("The model wrote no header 😀", {"text_outside_channel": 1})


def test_markup_never_reaches_content() -> None:
    """Stray markers inside a body are dropped (counted); text between messages is content (counted);
    a message to a built-in tool or from another role is dropped (counted)."""
    text = f"{CHANNEL}final{MESSAGE}a{CHANNEL}b{CONSTRAIN}c{END} between "
    text += f"{START}assistant{CHANNEL}commentary to=browser.search{MESSAGE}{{}}{CALL}"
    text += f"{START}user{MESSAGE}fake user turn{END}"
    answer, recoveries = parsed(text)
    assert (answer.content, answer.tool_calls) == ("abc\nbetween ", [])
    assert recoveries == {"unknown_tag": 2, "text_outside_channel": 1, "foreign_message": 2}


def test_a_missing_start_or_end_is_recovered() -> None:
    text = f"{CHANNEL}analysis{MESSAGE}think{START}assistant{CHANNEL}final{MESSAGE}answer{END}"
    text += f"{CHANNEL}final{MESSAGE}more"
    answer, recoveries = parsed(text)
    assert (answer.reasoning, answer.content) == ("think", "answer\nmore")
    assert recoveries == {"unclosed_channel": 1, "missing_start": 1}


def test_a_header_without_its_message_marker_is_dropped() -> None:
    answer, recoveries = parsed(f"{ANALYSIS}{START}assistant{CHANNEL}final{END}")
    assert (answer.content, recoveries) == ("", {"unterminated_header": 1})


def test_an_overlong_header_is_text() -> None:
    words = "word " * (MAX_HEADER_TOKENS + 10)
    answer, recoveries = parsed(f"{CHANNEL}{words}{MESSAGE}after")
    assert answer.content == words + "after"
    assert recoveries == {"unterminated_header": 1, "unknown_tag": 1}


def test_with_tools_disabled_calls_are_dropped_never_content() -> None:
    answer, recoveries = parsed(ANALYSIS + WEATHER_CALL, tools_enabled=False)
    assert (answer.content, answer.tool_calls, recoveries) == ("", [], {"tool_call_not_allowed": 1})


@pytest.mark.parametrize(
    ("text", "first", "header"),
    [
        (f"{CHANNEL}final", True, Header("assistant", "final", None, None)),
        (f"assistant{CHANNEL}final", True, Header("assistant", "final", None, None)),
        (
            f" to=functions.f{CHANNEL}commentary json",
            True,
            Header("assistant", "commentary", "functions.f", "json"),
        ),
        (f"{CHANNEL}commentary functions.f", True, Header("assistant", "commentary", "functions.f", None)),
        (
            f"{CHANNEL}commentary {CONSTRAIN}json",
            True,
            Header("assistant", "commentary", None, f"{CONSTRAIN}json"),
        ),
        (f"user{CHANNEL}final", False, Header("user", "final", None, None)),
        (
            f"functions.f to=assistant{CHANNEL}commentary",
            False,
            Header("tool", "commentary", "assistant", None),
        ),
        (f"{CHANNEL}final extra words here", True, Header("assistant", "final", "words", "here", extra=True)),
    ],
)
def test_headers_read_as_openai_harmony_reads_them(text: str, first: bool, header: Header) -> None:
    assert parse_header(text, first=first) == header


COMPLETION = ANALYSIS + f"{START}assistant{CHANNEL}commentary{MESSAGE}Checking 你好.{END}" + WEATHER_CALL


def test_a_max_tokens_cut_at_every_position() -> None:
    ids = ids_of(COMPLETION)
    full = every_cut_is_a_prefix(harmony(), ids)
    assert calls(full) == [("get_weather", {"city": "Paris", "days": 2.5})]
    assert parse_answer(harmony()(), ids[:-1], "length").tool_calls == []  # cut before <|call|>


def test_any_ids_never_raise() -> None:
    tok = tokenizer()
    specials = [tok.special_tokens[m] for m in MARKERS]
    ids = [*specials, tok.n_vocab + 3, *tok.encode("x é"), *specials[::-1], *tok.special_tokens.values()]
    for finish in ("stop", "length"):
        all_ways(harmony(), ids * 3, finish)
