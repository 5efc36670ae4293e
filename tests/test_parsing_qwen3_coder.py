"""Qwen3-Coder XML tool calls (``qwen3_coder``) on the Qwen3 vocabulary (``<tool_call>`` an added
token, the function and parameter tags text): values are raw text typed by the declared tool's
schema as vLLM types them, calls are released whole, what is no call stays content, counted."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids
from test_parsing_streams import QWEN
from test_parsing_streams import tokenizer as demo_tokenizer

from dynamo_prep.parsing import AnswerParser, ParsedAnswer, ParseOptions, parser_for, tool_properties
from dynamo_prep.parsing._schema_types import typed_value
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.tokenizer import Tokenizer

OPEN, CLOSE, THINK_CLOSE = "<tool_call>", "</tool_call>", "</think>"
PROPERTIES = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "flag": {"type": "boolean"},
    "options": {"type": "object"},
    "items": {"type": "array"},
    "maybe": {"type": ["integer", "null"]},
    "unit": {"enum": ["c", "f"]},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": PROPERTIES}}}]


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(built_models()["qwen3"])


def make(
    *,
    reasoning: str | None = None,
    tok: Tokenizer | None = None,
    tools: list[Any] | None = TOOLS,
    **options: Any,
) -> Callable[[], AnswerParser]:
    vocab = vocab_of(tok or tokenizer())
    properties = tool_properties(tools)
    return lambda: parser_for(
        vocab,
        reasoning,
        "qwen3_coder",
        ParseOptions(call_ids=counting_ids(), tool_properties=properties, **options),
    )


def ids_of(*parts: str, tok: Tokenizer | None = None) -> list[int]:
    tok = tok or tokenizer()
    return tok.encode_segments([(part, part in (OPEN, CLOSE, THINK_CLOSE)) for part in parts if part])


def function(name: str, *parameters: tuple[str, str], close: bool = True) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"\n<function={name}>\n{body}" + ("</function>\n" if close else "")


def call(name: str, *parameters: tuple[str, str]) -> tuple[str, str, str]:
    return (OPEN, function(name, *parameters), CLOSE)


def parsed(
    *parts: str, finish: str = "stop", maker: Callable[[], AnswerParser] | None = None
) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(maker or make(), ids_of(*parts), finish)


def calls(answer: ParsedAnswer) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


def test_a_call_with_typed_values() -> None:
    answer, recoveries = parsed(
        "Let me check.\n",
        *call(
            "get_weather",
            ("city", 'Paris <b> & "Lyon"'),
            ("days", "3"),
            ("ratio", "2.50"),
            ("flag", "True"),
            ("options", '{"a": [1, 2.5], "b": null}'),
            ("items", '["x", {"y": 1}]'),
            ("maybe", "null"),
            ("unit", "c"),
            ("free", "42"),
        ),
    )
    assert (answer.content, recoveries) == ("Let me check.\n", {})
    assert calls(answer) == [
        (
            "get_weather",
            {
                "city": 'Paris <b> & "Lyon"',
                "days": 3,
                "ratio": 2.5,
                "flag": True,
                "options": {"a": [1, 2.5], "b": None},
                "items": ["x", {"y": 1}],
                "maybe": None,
                "unit": "c",
                "free": "42",  # no schema: a string
            },
        )
    ]
    assert answer.tool_calls[0].arguments.startswith('{"city":"Paris <b> & \\"Lyon\\"","days":3,')


def test_without_the_tools_schema_every_value_is_a_string() -> None:
    answer, _ = parsed(*call("get_weather", ("days", "3"), ("flag", "true")), maker=make(tools=None))
    assert calls(answer) == [("get_weather", {"days": "3", "flag": "true"})]


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("7", {"type": "integer"}, 7),
        (" 7 ", {"type": "integer"}, 7),
        ("1.0", {"type": "number"}, 1),  # vLLM: a whole float becomes an int
        ("1e400", {"type": "number"}, "1e400"),  # not finite: kept as text
        ("nan", {"type": "number"}, "nan"),
        ("abc", {"type": "integer"}, "abc"),
        ("[1, 2]", {"type": "integer"}, [1, 2]),  # no type reads it: any finite JSON
        ("yes", {"type": "boolean"}, "yes"),
        ("0", {"type": "boolean"}, False),
        ("NULL", {"type": ["null", "string"]}, None),
        ("x", {"type": ["null", "string"]}, "x"),
        ("[1]", {"type": "object"}, [1]),  # vLLM reads object and array alike: any JSON
        ("[NaN]", {"type": "array"}, "[NaN]"),
        ("5", {"anyOf": [{"type": "string"}, {"type": "int"}]}, 5),  # aliases, branches
        ("5", {"enum": ["a", 5]}, 5),
        ("5", {"type": "mystery"}, 5),
        ("5", {}, "5"),
        ("5", "not a schema", "5"),
    ],
)
def test_values_are_typed_as_vllm_types_them(text: str, schema: Any, value: Any) -> None:
    assert typed_value(text, schema) == value
    assert type(typed_value(text, schema)) is type(value)


def test_one_newline_on_each_side_of_a_value_is_markup() -> None:
    answer, _ = parsed(
        OPEN,
        "<function=f>\n<parameter=a>\n\n x \n\n</parameter>\n<parameter=b>y</parameter>\n</function>",
        CLOSE,
    )
    assert calls(answer) == [("f", {"a": "\n x \n", "b": "y"})]


def test_several_calls_text_around_them_whitespace_between_them_dropped() -> None:
    answer, recoveries = parsed(
        "Hi", *call("get_weather", ("city", "Oslo")), "\n", *call("f"), "\n", function("g"), " Done.\n"
    )
    assert calls(answer) == [("get_weather", {"city": "Oslo"}), ("f", {}), ("g", {})]
    # text after a call keeps the whitespace before it; g had no <tool_call> around it
    assert (answer.content, recoveries) == ("Hi\n Done.\n", {"missing_tools_open": 1})


def test_several_functions_in_one_wrapper() -> None:
    answer, recoveries = parsed(OPEN, function("f", ("a", "1")), function("g"), CLOSE)
    assert (calls(answer), recoveries) == ([("f", {"a": "1"}), ("g", {})], {})


def test_a_wrapper_without_a_function_is_content_counted() -> None:
    body = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    answer, recoveries = parsed("Hi", OPEN, body, CLOSE, "bye")
    assert (answer.content, answer.tool_calls, recoveries) == (
        f"Hi{OPEN}{body}{CLOSE}bye",
        [],
        {"invalid_tool_call": 1},
    )


def test_a_name_that_never_closes_is_content() -> None:
    answer, recoveries = parsed(
        OPEN, "\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n", CLOSE
    )
    assert answer.tool_calls == [] and recoveries["invalid_tool_call"] == 1
    assert answer.content.startswith(OPEN + "\n<function=get_weather\n<parameter=")
    answer, recoveries = parsed("a <function=> b")
    assert (answer.content, recoveries) == (
        "a <function=> b",
        {"invalid_tool_call": 1, "missing_tools_open": 1},
    )


def test_a_function_opened_before_the_last_one_closed_ends_it() -> None:
    """However the text is chunked (a name's ">" and what follows it may come in one piece)."""
    answer, recoveries = parsed("a <function=> b <function=f>\n</function>")
    assert (answer.content, calls(answer)) == ("a <function=> b ", [("f", {})])
    assert recoveries == {"invalid_tool_call": 1, "missing_tools_open": 2}
    answer, recoveries = parsed(
        OPEN, "<function=f>\n<parameter=a>\n1\n</parameter>\n<function=g>\n</function>", CLOSE
    )
    assert (calls(answer), recoveries) == ([("f", {"a": "1"}), ("g", {})], {"unclosed_call": 1})


def test_recoveries_inside_a_function() -> None:
    # a value without </parameter> (kept), a key without ">" (dropped), text between parameters
    # (dropped), a key written twice (the later value, in the first place)
    body = "\n<function=f>\nnoise\n<parameter=a>\n1\n<parameter=b\n</parameter>\n"
    body += "<parameter=c>\n2\n</parameter>\n<parameter=a>\n3\n</parameter>\n</function>\n"
    answer, recoveries = parsed(OPEN, body, CLOSE)
    assert calls(answer) == [("f", {"a": "3", "c": "2"})]
    assert list(json.loads(answer.tool_calls[0].arguments)) == ["a", "c"]
    assert recoveries == {
        "garbage": 1,
        "unclosed_channel": 1,
        "argument_without_key": 1,
        "duplicate_argument": 1,
    }


def test_the_wrapper_closing_inside_a_function_ends_it() -> None:
    answer, recoveries = parsed(OPEN, function("f", ("a", "1"), close=False), CLOSE, "after", *call("g"))
    assert (calls(answer), answer.content) == ([("f", {"a": "1"}), ("g", {})], "after")
    assert recoveries == {"unclosed_call": 1}


def test_a_value_may_spell_the_wrapper_tags_and_angle_brackets() -> None:
    tok = demo_tokenizer(QWEN)  # the wrapper tags are text there: inside a value, text
    code = f"if a > b: print('{CLOSE}')"
    text = f"{OPEN}\n<function=f>\n<parameter=code>\n{code}\n</parameter>\n</function>\n{CLOSE}"
    answer, recoveries = all_ways(make(tok=tok), tok.encode(text))
    assert (calls(answer), recoveries) == ([("f", {"code": code})], {})


def test_the_model_ending_inside_a_call() -> None:
    answer, recoveries = parsed(OPEN, "\n<function=get_weather>\n<parameter=days>\n3")
    assert (calls(answer), recoveries) == (
        [("get_weather", {"days": 3})],
        {"unclosed_channel": 1, "unclosed_call": 1},
    )


def test_a_max_tokens_cut_never_half_sends_a_call_and_counts_nothing() -> None:
    ids = ids_of("Hi", *call("get_weather", ("city", "Paris"), ("days", "3")), "\n", *call("f"))
    full, _ = all_ways(make(), ids)
    for cut in range(len(ids) + 1):
        answer, recoveries = all_ways(make(), ids[:cut], "length")
        assert recoveries == {}
        assert answer.tool_calls == full.tool_calls[: len(answer.tool_calls)]
        assert answer.content == "Hi"[: len(answer.content)]


def test_with_qwen3_reasoning_and_tool_choice_none() -> None:
    maker = make(reasoning="qwen3", thinking=True)
    answer, recoveries = parsed(
        "I should look.", THINK_CLOSE, "\n\n", *call("get_weather", ("days", "2")), maker=maker
    )
    assert (answer.reasoning, calls(answer), recoveries) == (
        "I should look.",
        [("get_weather", {"days": 2})],
        {},
    )
    answer, recoveries = parsed("Sure.", *call("f"), maker=make(tools_enabled=False))
    assert (answer.content, answer.tool_calls, recoveries) == ("Sure.", [], {"tool_call_not_allowed": 1})


def test_tool_properties_reads_the_first_function_tool_of_each_name() -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}},
        },
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}},
        {"type": "function", "function": {"name": "g"}},
        {"type": "custom"},
        "junk",
    ]
    assert tool_properties(tools) == {"f": {"a": {"type": "integer"}}, "g": {}}
    assert tool_properties(None) == {}


# -- anything at all -------------------------------------------------------------------------------

PIECES = (
    OPEN,
    CLOSE,
    THINK_CLOSE,
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "get_weather",
    "days",
    "city",
    ">",
    "\n",
    " ",
    "3",
    "true",
    '{"a": [1',
    "]}",
    "你好 😀",
    "<",
    "<func",
)


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=40),
    reasoning=st.sampled_from([None, "qwen3"]),
    thinking=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
)
def test_any_sequence_of_tags_and_text_gives_only_documented_behaviour(
    pieces: list[str], reasoning: str | None, thinking: bool, finish: str
) -> None:
    answer, recoveries = parsed(*pieces, finish=finish, maker=make(reasoning=reasoning, thinking=thinking))
    for tool_call in answer.tool_calls:
        assert tool_call.name and isinstance(json.loads(tool_call.arguments), dict)
    if not recoveries.get("invalid_tool_call"):  # only what is no call keeps its tags
        assert OPEN not in answer.content and "<function=" not in answer.content


def test_a_hostile_100k_id_answer_keeps_every_character() -> None:
    """Wrappers that never hold a function, then text: each is content, counted, in one pass."""
    ids = ids_of(*[OPEN, "x", CLOSE] * 30_000, "end")
    answer, recoveries = all_ways(make(), ids, seeds=(0,))
    assert answer.content == f"{OPEN}x{CLOSE}" * 30_000 + "end"
    assert recoveries == {"invalid_tool_call": 30_000}
