"""GLM-4.5 answers (``glm45`` reasoning and tool calls) on a GLM-4.5-style vocabulary (think, call and
argument tags special tokens): ``<think>`` reasoning, ``<tool_call>NAME <arg_key>/<arg_value>``
calls whose values are typed by the request's tool schemas as vLLM types them."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix, marked_ids

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.parsing import AnswerParser, ParsedAnswer, answer_parser_for
from dynamo_prep.parsing._schema_types import tool_properties, typed_value
from dynamo_prep.tokenizer import Tokenizer

THINK, END_THINK, CALL, END_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
MARKERS = (THINK, END_THINK, CALL, END_CALL, KEY, END_KEY, VALUE, END_VALUE)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "hot": {"type": "boolean"},
                    "where": {"type": "object"},
                    "zip": {"type": ["integer", "null"]},
                },
            },
        },
    }
]


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(built_models()["glm45"])


@cache
def card() -> ModelDeploymentCard:
    runtime = ModelRuntimeConfig(tool_call_parser="glm45", reasoning_parser="glm45")
    return ModelDeploymentCard.from_model_dir(built_models()["glm45"], runtime_config=runtime)


def glm(
    *, tools_enabled: bool = True, tools: list[dict[str, Any]] | None = None
) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(),
        tokenizer(),
        thinking=False,
        tools_enabled=tools_enabled,
        call_ids=counting_ids(),
        tool_properties=tool_properties(TOOLS if tools is None else tools),
    )


def ids_of(text: str) -> list[int]:
    return marked_ids(tokenizer(), MARKERS, text)


def parsed(text: str, finish: str = "stop", **options: Any) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(glm(**options), ids_of(text), finish)


def call(name: str, **pairs: str) -> str:
    body = "".join(f"{KEY}{k}{END_KEY}\n{VALUE}{v}{END_VALUE}\n" for k, v in pairs.items())
    return f"{CALL}{name}\n{body}{END_CALL}"


def calls(answer: ParsedAnswer) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]


WEATHER = call("get_weather", city="Paris 你好", days="3")


def test_reasoning_content_and_calls() -> None:
    answer, recoveries = parsed(f"\n{THINK}The user asks 😀.{END_THINK}\nChecking.\n{WEATHER}\n{WEATHER}\n")
    assert (answer.reasoning, answer.content, recoveries) == ("The user asks 😀.", "\nChecking.\n", {})
    assert calls(answer) == [("get_weather", {"city": "Paris 你好", "days": 3})] * 2
    assert answer.tool_calls[0].arguments == '{"city":"Paris 你好","days":3}'
    assert glm()().family == "glm45"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("city", "3", "3"),  # a string parameter keeps the text
        ("days", "3", 3),
        ("days", "three", "three"),  # not an integer: kept as text
        ("hot", "True", True),
        ("hot", "0", False),
        ("where", '{"lat": 1.5, "s": "a\\"b"}', {"lat": 1.5, "s": 'a"b'}),
        ("zip", "null", None),
        ("zip", "75001", 75001),
        ("undeclared", "[1, 2]", "[1, 2]"),  # no schema: text, as vLLM keeps it
    ],
)
def test_values_are_typed_by_the_schema(key: str, value: str, expected: object) -> None:
    answer, _ = parsed(call("get_weather", **{key: value}))
    assert calls(answer) == [("get_weather", {key: expected})]


def test_without_schemas_values_are_text() -> None:
    answer, _ = parsed(WEATHER, tools=[])
    assert calls(answer) == [("get_weather", {"city": "Paris 你好", "days": "3"})]


def test_schema_types_as_vllm_extracts_them() -> None:
    tools = [
        {
            "function": {
                "name": "f",
                "parameters": {
                    "properties": {
                        "e": {"enum": ["a", 1, None]},
                        "u": {"anyOf": [{"type": "number"}, {"oneOf": [{"type": "boolean"}]}]},
                        "x": {},
                    }
                },
            }
        }
    ]
    properties = tool_properties(tools)
    assert "g" not in properties
    f = properties["f"]
    assert typed_value("1", f["e"]) == 1 and typed_value("a", f["e"]) == "a"
    assert typed_value("null", f["e"]) is None
    assert typed_value("true", f["u"]) is True and typed_value("2.5", f["u"]) == 2.5
    assert typed_value("1", f["x"]) == "1"
    assert typed_value("1.0", {"type": "number"}) == 1
    assert typed_value("NaN", {"type": "number"}) == "NaN"
    assert typed_value("1e999", {"type": ["integer", "number"]}) == "1e999"


def test_a_call_opens_right_after_the_name_and_may_have_no_arguments() -> None:
    answer, _ = parsed(
        f"{CALL}get_weather{KEY}city{END_KEY}{VALUE}Lima{END_VALUE}{END_CALL}{CALL}f{END_CALL}"
    )
    assert calls(answer) == [("get_weather", {"city": "Lima"}), ("f", {})]


def test_text_that_spells_tags_is_text() -> None:
    text = f"write {CALL}f{KEY}a{END_KEY} as text"
    answer, recoveries = all_ways(glm(), tokenizer().encode(text))
    assert (answer.content, answer.tool_calls, recoveries) == (text, [], {})


def test_recoveries() -> None:
    """A block without a name stays content, tags and all; stray tags are dropped; an unclosed value,
    call or think block is kept; a call inside reasoning ends it."""
    answer, recoveries = parsed(f"{CALL}\n{KEY}a{END_KEY}{VALUE}1{END_VALUE}{END_CALL}")
    assert answer.content == f"{CALL}\n{KEY}a{END_KEY}{VALUE}1{END_VALUE}{END_CALL}"
    assert recoveries == {"invalid_tool_call": 1}
    answer, recoveries = parsed(f"a{END_VALUE}b{CALL}f\n{KEY}k{END_KEY}junk{VALUE}v{KEY}k2{END_KEY}{VALUE}w")
    assert (answer.content, calls(answer)) == ("ab", [("f", {"k": "v", "k2": "w"})])
    assert recoveries == {"unknown_tag": 1, "garbage": 1, "unclosed_channel": 2, "unclosed_call": 1}
    answer, recoveries = parsed(f"{THINK}hmm{WEATHER}")
    assert (answer.reasoning, len(answer.tool_calls), recoveries) == ("hmm", 1, {"missing_think_close": 1})


def test_with_tools_disabled_calls_are_dropped_never_content() -> None:
    answer, recoveries = parsed(f"Hi{WEATHER}", tools_enabled=False)
    assert (answer.content, answer.tool_calls, recoveries) == ("Hi", [], {"tool_call_not_allowed": 1})


COMPLETION = f"{THINK}Think 你好.{END_THINK}\nChecking.\n{WEATHER}\n{call('get_weather', days='2')}\nDone 😀."


def test_a_max_tokens_cut_at_every_position() -> None:
    full = every_cut_is_a_prefix(glm(), ids_of(COMPLETION))
    assert len(full.tool_calls) == 2 and full.content == "\nChecking.\n\nDone 😀."
