"""Llama 3.1/3.2 JSON tool calls (``llama3_json``) on a real Llama 3 vocabulary (cl100k + Llama 3's
specials, ``<|python_tag|>`` a special token): calls at the start of the answer or after the tag,
``;``-separated, released whole; whatever is no call stays content, counted when it looked like one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.parsing import (
    AnswerParser,
    ParsedAnswer,
    ToolCallDelta,
    answer_parser_for,
)
from dynamo_prep.tokenizer import Tokenizer

TAG = "<|python_tag|>"
EOM = "<|eom_id|>"
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
SEARCH = '{"name": "search", "arguments": {"q": "cats 你好 😀", "n": 1.0}}'


@cache
def directory() -> Path:
    return built_models()["llama3"]


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(directory())


@cache
def card() -> ModelDeploymentCard:
    runtime = ModelRuntimeConfig(tool_call_parser="llama3_json")
    return ModelDeploymentCard.from_model_dir(directory(), runtime_config=runtime)


def llama(*, tools_enabled: bool = True, tools_declared: bool = True) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(),
        tokenizer(),
        thinking=False,
        tools_enabled=tools_enabled,
        tools_declared=tools_declared,
        call_ids=counting_ids(),
    )


def ids_of(text: str) -> list[int]:
    """``text`` as the model writes it: the python tag and eom as their ids, the rest as text."""
    segments: list[tuple[str, bool]] = []
    for index, piece in enumerate(text.replace(EOM, TAG + "\0").split(TAG)):
        if index:
            segments.append((EOM if piece.startswith("\0") else TAG, True))
        if rest := piece.removeprefix("\0") if index else piece:
            segments.append((rest, False))
    return tokenizer().encode_segments(segments)


def parsed(text: str, finish: str = "stop", **options: bool) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(llama(**options), ids_of(text), finish)


def calls(answer: ParsedAnswer) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
SEARCH_CALL = ("search", {"q": "cats 你好 😀", "n": 1.0})


def test_the_registry_builds_it_for_a_declared_name() -> None:
    assert llama()().family == "llama3_json"
    assert tokenizer().special_tokens[TAG] == tokenizer().added_tokens[TAG]


@pytest.mark.parametrize(
    "text",
    [
        WEATHER,
        f"{TAG}{WEATHER}{EOM}",
        f"  \n{WEATHER}\n",
        f"{TAG} {WEATHER}",
    ],
)
def test_one_call_with_or_without_the_python_tag(text: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL], {})
    assert answer.tool_calls[0] == ToolCallDelta(0, "call_0", "get_weather", '{"city":"Paris","days":3}')


@pytest.mark.parametrize("separator", ["; ", ";", " ; ", "\n", ";\n\n", f"; {TAG}"])
def test_several_calls(separator: str) -> None:
    answer, recoveries = parsed(f"{WEATHER}{separator}{SEARCH}")
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL, SEARCH_CALL], {})
    assert [call.index for call in answer.tool_calls] == [0, 1]


def test_arguments_keep_the_models_spelling_and_nest() -> None:
    body = '{"name": "f", "parameters": {"x": 1e2, "s": "}{\\"\\u00e9 ]", "n": {"a": [1, {"b": 2.50}]}}}'
    answer, _ = parsed(body)
    assert answer.tool_calls[0].arguments == '{"x":1e2,"s":"}{\\"\\u00e9 ]","n":{"a":[1,{"b":2.50}]}}'
    answer, _ = parsed('{"name": "f", "parameters": "{\\"x\\": 1}"}')
    assert answer.tool_calls[0].arguments == '{"x":1}'
    answer, _ = parsed('{"name": "f", "parameters": null}')
    assert answer.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "Sure: " + WEATHER,  # calls open the answer; later JSON is text
        '{"answer": 42}',  # an answer in JSON is no call
        "{name} is a placeholder",
        "[1, 2]",
    ],
)
def test_text_answers_are_content_as_written(text: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, answer.tool_calls, recoveries) == (text, [], {})


def test_text_that_spells_the_tag_is_text() -> None:
    text = f"say {TAG} typed, then {WEATHER}"
    answer, recoveries = all_ways(llama(), tokenizer().encode(text))
    assert (answer.content, answer.tool_calls, recoveries) == (text, [], {})


def test_text_after_the_calls_is_content_unless_it_is_whitespace() -> None:
    answer, recoveries = parsed(f"{WEATHER}; {SEARCH}\n\nDone.")
    assert (answer.content, calls(answer), recoveries) == ("\n\nDone.", [WEATHER_CALL, SEARCH_CALL], {})
    answer, _ = parsed(f"{WEATHER}; and more")
    assert answer.content == "; and more"
    answer, _ = parsed(f"{WEATHER} \n ")
    assert answer.content == ""


def test_the_python_tag_opens_calls_after_text() -> None:
    answer, recoveries = parsed(f"Let me check.{TAG}{WEATHER}{EOM}")
    assert (answer.content, calls(answer), recoveries) == ("Let me check.", [WEATHER_CALL], {})


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('{"name": "f"}', '{"name": "f"}'),  # no parameters
        ('{"name": "", "parameters": {}}', '{"name": "", "parameters": {}}'),
        ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}'),
        (f'{TAG}brave_search.call(query="x")', 'brave_search.call(query="x")'),  # a built-in tool
        (f"{TAG}", ""),
        ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}'),  # ended inside
        ('{"name": "f", "parameters": {"a": NaN}}', '{"name": "f", "parameters": {"a": NaN}}'),
    ],
)
def test_what_looks_like_a_call_but_is_none_stays_content_and_is_counted(text: str, content: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, answer.tool_calls, recoveries) == (content, [], {"invalid_tool_call": 1})


def test_a_bad_object_after_calls_keeps_the_calls_and_the_rest_is_content() -> None:
    answer, recoveries = parsed(f'{WEATHER}; {{"name": 1}} tail')
    assert (calls(answer), answer.content, recoveries) == (
        [WEATHER_CALL],
        '; {"name": 1} tail',
        {"invalid_tool_call": 1},
    )


def test_a_python_tag_inside_an_object_leaves_its_text_as_content() -> None:
    answer, recoveries = parsed(f'{{"name": "f", {TAG}{WEATHER}')
    assert (answer.content, calls(answer), recoveries) == (
        '{"name": "f", ',
        [WEATHER_CALL],
        {"invalid_tool_call": 1},
    )


def test_without_declared_tools_json_is_content_and_with_tools_disabled_calls_are_dropped() -> None:
    answer, recoveries = parsed(WEATHER, tools_declared=False)
    assert (answer.content, answer.tool_calls, recoveries) == (WEATHER, [], {})
    answer, recoveries = parsed(f"{WEATHER}; {SEARCH}", tools_enabled=False)
    assert (answer.content, answer.tool_calls, recoveries) == ("", [], {"tool_call_not_allowed": 2})


COMPLETION = f"{TAG}{WEATHER}; {SEARCH}\n\nDone 😀."


def test_a_max_tokens_cut_at_every_position() -> None:
    """No error, no half call, nothing counted; the answer is a prefix of the whole, and streamed id by
    id no released content is taken back."""
    ids = ids_of(COMPLETION)
    full = every_cut_is_a_prefix(llama(), ids)
    assert (full.content, calls(full)) == ("\n\nDone 😀.", [WEATHER_CALL, SEARCH_CALL])


def test_a_long_object_is_released_whole_when_it_closes() -> None:
    """A 20k-character string value full of escaped quotes: nothing is released before the last id."""
    body = '{"name": "f", "parameters": {"s": "' + 'ab\\"c ' * 5000 + '"}}'
    ids = ids_of(body)
    parser = llama()()
    released = [(at, d) for at, token_id in enumerate(ids) for d in parser.feed([token_id])]
    assert parser.finish("stop") == []
    [(at, call)] = released
    assert at == len(ids) - 1 and isinstance(call, ToolCallDelta)
    assert json.loads(call.arguments)["s"].startswith('ab"c ab"c')
