"""Kimi-K2 tool calls (``kimi_k2``) on a Kimi-K2-style vocabulary (the section and call markers special
tokens): calls inside ``<|tool_calls_section_begin|>``, each id the model's ``functions.NAME:IDX``,
arguments a JSON object released whole; what is not a call stays content, counted."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix, marked_ids

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.parsing import AnswerParser, ParsedAnswer, answer_parser_for
from dynamo_prep.parsing.kimi_k2 import call_id_and_name
from dynamo_prep.tokenizer import Tokenizer

SECTION, END_SECTION = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGUMENTS, END_CALL = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SECTION, END_SECTION, CALL, ARGUMENTS, END_CALL, "<|im_end|>")


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(built_models()["kimi_k2"])


@cache
def card() -> ModelDeploymentCard:
    runtime = ModelRuntimeConfig(tool_call_parser="kimi_k2")
    return ModelDeploymentCard.from_model_dir(built_models()["kimi_k2"], runtime_config=runtime)


def kimi(*, tools_enabled: bool = True) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(), tokenizer(), thinking=False, tools_enabled=tools_enabled, call_ids=counting_ids()
    )


def ids_of(text: str) -> list[int]:
    return marked_ids(tokenizer(), MARKERS, text)


def parsed(text: str, finish: str = "stop", **options: bool) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(kimi(**options), ids_of(text), finish)


def call(name: str, index: int, arguments: str) -> str:
    return f"{CALL}functions.{name}:{index}{ARGUMENTS}{arguments}{END_CALL}"


def calls(answer: ParsedAnswer) -> list[tuple[str, str, object]]:
    return [(c.id, c.name, json.loads(c.arguments)) for c in answer.tool_calls]


WEATHER = call("get_weather", 0, '{"city": "Paris", "n": 1.0}')
SEARCH = call("search", 1, '{"q": "cats 你好 😀"}')


def test_calls_keep_the_models_ids() -> None:
    answer, recoveries = parsed(f"Let me check.{SECTION}{WEATHER}{SEARCH}{END_SECTION}<|im_end|>")
    assert (answer.content, recoveries) == ("Let me check.", {})
    assert calls(answer) == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris", "n": 1.0}),
        ("functions.search:1", "search", {"q": "cats 你好 😀"}),
    ]
    assert answer.tool_calls[0].arguments == '{"city":"Paris","n":1.0}'
    assert card().runtime_config.tool_call_parser == kimi()().family == "kimi_k2"


def test_whitespace_around_the_section_is_not_content_text_after_it_is() -> None:
    answer, recoveries = parsed(f"\n {SECTION}\n{WEATHER}\n{END_SECTION}\n")
    assert (answer.content, len(answer.tool_calls), recoveries) == ("", 1, {})
    answer, _ = parsed(f"{SECTION}{WEATHER}{END_SECTION}\n\nDone 😀.")
    assert answer.content == "\n\nDone 😀."


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("functions.get_weather:0", ("functions.get_weather:0", "get_weather")),
        (" functions.get_weather:12 ", ("functions.get_weather:12", "get_weather")),
        ("get_weather:3", ("get_weather:3", "get_weather")),
        ("functions.get_weather", (None, "get_weather")),
        ("functions.a:b:7", ("functions.a:b:7", "a")),
        (":0", (None, "")),
    ],
)
def test_call_headers_as_vllm_reads_them(header: str, expected: tuple[str | None, str]) -> None:
    assert call_id_and_name(header) == expected


def test_a_header_without_an_index_gets_a_new_id() -> None:
    answer, _ = parsed(f"{SECTION}{CALL}functions.f{ARGUMENTS}{{}}{END_CALL}{END_SECTION}")
    assert calls(answer) == [("call_0", "f", {})]


def test_text_that_spells_markers_is_text() -> None:
    text = f"write {SECTION}{CALL}functions.f:0{ARGUMENTS}{{}} as text"
    answer, recoveries = all_ways(kimi(), tokenizer().encode(text))
    assert (answer.content, answer.tool_calls, recoveries) == (text, [], {})


BAD_JSON = call("f", 0, '{"a": }')
NOT_AN_OBJECT = call("f", 0, "[1]")


@pytest.mark.parametrize(
    ("text", "content", "kind"),
    [
        (f"{SECTION}{BAD_JSON}{END_SECTION}", 'functions.f:0{"a": }', "invalid_tool_call"),
        (f"{SECTION}{NOT_AN_OBJECT}{END_SECTION}", "functions.f:0[1]", "invalid_tool_call"),
        (f"{SECTION}{CALL}:0{ARGUMENTS}{{}}{END_CALL}{END_SECTION}", ":0{}", "invalid_tool_call"),
    ],
)
def test_what_is_no_call_stays_content_and_is_counted(text: str, content: str, kind: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, answer.tool_calls, recoveries) == (content, [], {kind: 1})


def test_recoveries() -> None:
    """A call outside a section opens one; a call left open by the next call, the section's end or
    the answer's end is kept when its arguments are whole; text inside the section is dropped."""
    answer, recoveries = parsed(WEATHER + f"{END_SECTION}after")
    assert (len(answer.tool_calls), answer.content, recoveries) == (1, "after", {"missing_tools_open": 1})
    open_call = f"{CALL}functions.f:1{ARGUMENTS}{{}}"
    answer, recoveries = parsed(f"{SECTION}{open_call}{WEATHER}junk{open_call}{END_SECTION}{open_call}")
    assert [c.name for c in answer.tool_calls] == ["f", "get_weather", "f", "f"]
    assert recoveries == {"unclosed_call": 3, "garbage": 1, "missing_tools_open": 1}
    answer, recoveries = parsed(f"x{END_CALL}y{ARGUMENTS}z")
    assert (answer.content, recoveries) == ("xyz", {"unknown_tag": 2})


def test_with_tools_disabled_calls_are_dropped_never_content() -> None:
    answer, recoveries = parsed(f"Hi{SECTION}{WEATHER}{SEARCH}{END_SECTION}", tools_enabled=False)
    assert (answer.content, answer.tool_calls, recoveries) == ("Hi", [], {"tool_call_not_allowed": 2})


COMPLETION = f"Checking 你好.{SECTION}{WEATHER}{SEARCH}{END_SECTION} Done 😀."


def test_a_max_tokens_cut_at_every_position() -> None:
    full = every_cut_is_a_prefix(kimi(), ids_of(COMPLETION))
    assert len(full.tool_calls) == 2 and full.content == "Checking 你好. Done 😀."
