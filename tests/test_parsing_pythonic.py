"""Pythonic tool calls (``pythonic``, ``llama4_pythonic``) on real Llama 3 and Llama 4 vocabularies:
``[f(a=1, b="x"), g()]`` with Python literals at the start of the answer (Llama 4: or after
``<|python_start|>``, a special token), each call released as its parentheses close, its arguments
a JSON object; what is no call stays content, counted when it was meant as one. Literals are read
by a small reader, never eval: ``ast.literal_eval`` is the reference here.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix, marked_ids

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.parsing import (
    AnswerParser,
    ParsedAnswer,
    ToolCallDelta,
    answer_parser_for,
)
from dynamo_prep.parsing._python import MAX_NESTING, OPEN, REFUSED, ArgumentsEnd, NotACallError, parse_call
from dynamo_prep.tokenizer import Tokenizer

START, END, EOM = "<|python_start|>", "<|python_end|>", "<|eom|>"
LLAMA3_EOM = "<|eom_id|>"
MARKERS = (START, END, EOM, LLAMA3_EOM)
WEATHER = "get_weather(city='Paris', days=3)"
SEARCH = 'search(q="cats 你好 😀", n=1.0, exact=True, lang=None)'
WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
SEARCH_CALL = ("search", {"q": "cats 你好 😀", "n": 1.0, "exact": True, "lang": None})


@cache
def directory(family: str) -> Path:
    return built_models()[family]


@cache
def tokenizer(family: str) -> Tokenizer:
    return Tokenizer.from_model_dir(directory(family))


@cache
def card(parser: str) -> ModelDeploymentCard:
    family = "llama4" if parser == "llama4_pythonic" else "llama3"
    runtime = ModelRuntimeConfig(tool_call_parser=parser)
    return ModelDeploymentCard.from_model_dir(directory(family), runtime_config=runtime)


def make(
    parser: str = "llama4_pythonic", *, tools_enabled: bool = True, tools_declared: bool = True
) -> Callable[[], AnswerParser]:
    family = "llama4" if parser == "llama4_pythonic" else "llama3"
    return lambda: answer_parser_for(
        card(parser),
        tokenizer(family),
        thinking=False,
        tools_enabled=tools_enabled,
        tools_declared=tools_declared,
        call_ids=counting_ids(),
    )


def ids_of(text: str, family: str = "llama4") -> list[int]:
    """``text`` as Llama 4 writes it: its python tags and eom as their ids, the rest as text."""
    return marked_ids(tokenizer(family), MARKERS, text)


def parsed(
    text: str, finish: str = "stop", parser: str = "llama4_pythonic", **options: bool
) -> tuple[ParsedAnswer, dict[str, int]]:
    family = "llama4" if parser == "llama4_pythonic" else "llama3"
    if family == "llama3":
        text = text.replace(EOM, LLAMA3_EOM)
    return all_ways(make(parser, **options), ids_of(text, family), finish)


def calls(answer: ParsedAnswer) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


def test_the_registry_builds_both_names() -> None:
    assert make("pythonic")().family == "pythonic"
    assert make("llama4_pythonic")().family == "llama4_pythonic"
    assert tokenizer("llama4").is_special_token(START) and tokenizer("llama4").is_special_token(END)


@pytest.mark.parametrize("parser", ["pythonic", "llama4_pythonic"])
@pytest.mark.parametrize(
    "text",
    [f"[{WEATHER}]", f"[{WEATHER}]{EOM}", f"  \n[{WEATHER}]\n", f"[ {WEATHER} , ]", f"[\n  {WEATHER}\n]"],
)
def test_one_call(parser: str, text: str) -> None:
    answer, recoveries = parsed(text, parser=parser)
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL], {})
    assert answer.tool_calls[0] == ToolCallDelta(0, "call_0", "get_weather", '{"city":"Paris","days":3}')


@pytest.mark.parametrize(
    "text", [f"{START}[{WEATHER}]{END}", f"{START}[{WEATHER}]", f" {START} [{WEATHER}] {END}"]
)
def test_llama4_wraps_the_list_in_python_tags(text: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL], {})


@pytest.mark.parametrize("separator", [", ", ",", ",\n  ", " , "])
def test_several_calls(separator: str) -> None:
    answer, recoveries = parsed(f"[{WEATHER}{separator}{SEARCH}]")
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL, SEARCH_CALL], {})
    assert [call.index for call in answer.tool_calls] == [0, 1]


LITERALS = [
    ("'it\\'s'", "it's"),
    ('"a\\"b\\\\c"', 'a"b\\c'),
    ("'\\n\\t\\x41\\101\\u00e9\\U0001F600\\N{SNOWMAN}'", "\n\tAAé😀☃"),
    ("'\\d'", "\\d"),  # an unknown escape keeps its backslash
    ("r'\\n\\d'", "\\n\\d"),
    ("'''one\ntwo'''", "one\ntwo"),
    ('"""say "hi" """', 'say "hi" '),
    ("'con' \"cat\" '''enated'''", "concatenated"),
    ("u'x'", "x"),
    ("f'no fields'", "no fields"),
    ("-1", -1),
    ("+2.5", 2.5),
    ("--3", 3),
    ("-(4)", -4),
    ("1_000", 1000),
    ("0x1f", 31),
    ("0o17", 15),
    ("0b101", 5),
    ("1e3", 1000.0),
    (".5", 0.5),
    ("5.", 5.0),
    ("True", True),
    ("False", False),
    ("None", None),
    ("true", True),  # JSON spellings some models write
    ("false", False),
    ("null", None),
    ("[1, [2, [3]]]", [1, [2, [3]]]),
    ("(1, 2)", [1, 2]),  # a tuple is a JSON array
    ("(1,)", [1]),
    ("(1)", 1),  # parentheses around one value
    ("()", []),
    ("{1, 2}", [1, 2]),  # a set too, in the order written
    ("{}", {}),
    ("{'a': {'b': [None, True]}}", {"a": {"b": [None, True]}}),
    ("{1: 'x', 2.5: 'y', None: 'z', True: 'w'}", {"1": "w", "2.5": "y", "null": "z"}),  # True == 1
    ("{'k': 1, 'k': 2, 'j': 3}", {"k": 2, "j": 3}),  # a key written twice: the later value
    ("[1, 2, ]", [1, 2]),
]


@pytest.mark.parametrize(("literal", "value"), LITERALS)
def test_python_literals_become_json(literal: str, value: Any) -> None:
    answer, recoveries = parsed(f"[f(x={literal})]")
    assert (answer.content, calls(answer), recoveries) == ("", [("f", {"x": value})], {})
    json.loads(answer.tool_calls[0].arguments)  # strict JSON


def test_arguments_are_compact_json_in_the_order_written() -> None:
    answer, _ = parsed("[f(b=1, a='x', c=[1.5, {'k': None}])]")
    assert answer.tool_calls[0].arguments == '{"b":1,"a":"x","c":[1.5,{"k":null}]}'
    answer, _ = parsed("[f(s='\\ud800')]")  # a lone surrogate: escaped, so the arguments stay UTF-8
    assert answer.tool_calls[0].arguments == '{"s":"\\ud800"}'
    answer.tool_calls[0].arguments.encode()


def test_a_keyword_given_twice_keeps_its_place_and_takes_the_later_value() -> None:
    answer, recoveries = parsed("[f(a=1, b=2, a=3)]")
    assert (answer.tool_calls[0].arguments, recoveries) == ('{"a":3,"b":2}', {"duplicate_argument": 1})


def test_dotted_names_and_no_arguments() -> None:
    answer, _ = parsed("[brave_search.call(query='x'), g()]")
    assert calls(answer) == [("brave_search.call", {"query": "x"}), ("g", {})]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        f"Sure: [{WEATHER}]",  # the list opens the answer; later it is text
        "[1, 2, 3]",  # an answer that is a list
        "[citation needed] and more",
        "[a, b]",
        "[]",
        '[{"name": "f", "parameters": {}}]',
        "{'a': 1}",
    ],
)
def test_text_answers_are_content_as_written(text: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, answer.tool_calls, recoveries) == (text, [], {})


@pytest.mark.parametrize(
    "call",
    [
        "f(1)",  # positional
        "f(a=1, 2)",
        "f(a==1)",
        "f(a=x)",  # a name
        "f(a=b'x')",  # bytes
        "f(a=1j)",
        "f(a=1e999)",  # no JSON number
        "f(a=f'{x}')",
        "f(a='unclosed\n')",
        "f(class=1)",
        "f(a=-True)",
        "f(a={[1]: 2})",
        "f(a={**b})",
        "f(a=1 + 2)",
        "f(a=1 # comment\n)",
        "f(a=[1)",
        "1f(a=1)",
        "f(a=" + "[" * MAX_NESTING + "]" * MAX_NESTING + ")",
        "f(a=0x" + "f" * 20_000 + ")",  # more digits than Python prints
    ],
)
def test_what_is_no_call_stays_content_and_is_counted(call: str) -> None:
    answer, recoveries = parsed(f"[{call}]")
    assert (answer.content, answer.tool_calls) == (f"[{call}]", [])
    assert recoveries == ({"invalid_tool_call": 1} if call[0] != "1" else {})


def test_a_bad_call_after_calls_keeps_the_calls_and_the_rest_is_content() -> None:
    answer, recoveries = parsed(f"[{WEATHER}, f(a=x), {SEARCH}] tail")
    assert (calls(answer), answer.content, recoveries) == (
        [WEATHER_CALL],
        f", f(a=x), {SEARCH}] tail",
        {"invalid_tool_call": 1},
    )


def test_text_after_the_list_is_content_unless_it_is_whitespace() -> None:
    answer, recoveries = parsed(f"[{WEATHER}]\n\nDone.")
    assert (answer.content, calls(answer), recoveries) == ("\n\nDone.", [WEATHER_CALL], {})
    answer, _ = parsed(f"[{WEATHER}] \n ")
    assert answer.content == ""
    answer, _ = parsed(f"[{WEATHER}] [{SEARCH}]")  # one list
    assert (answer.content, calls(answer)) == (f" [{SEARCH}]", [WEATHER_CALL])


def test_python_start_opens_a_list_after_text_and_python_end_closes_it() -> None:
    answer, recoveries = parsed(f"Let me check.{START}[{WEATHER}]{END} Done [{SEARCH}]")
    assert (answer.content, calls(answer), recoveries) == (
        f"Let me check. Done [{SEARCH}]",
        [WEATHER_CALL],
        {},
    )


def test_the_python_tags_spelled_in_text_are_text() -> None:
    text = f"say {START} [{WEATHER}]"
    answer, recoveries = all_ways(make(), tokenizer("llama4").encode(text))
    assert (answer.content, answer.tool_calls, recoveries) == (text, [], {})
    answer, _ = all_ways(make(), tokenizer("llama4").encode(f"[f(a='{START}')]"))
    assert calls(answer) == [("f", {"a": START})]


@pytest.mark.parametrize(
    ("text", "content", "recoveries"),
    [
        (
            f"{START}brave_search.call(query='x'){END}",
            "brave_search.call(query='x')",
            {"invalid_tool_call": 1},
        ),
        (f"{START}{END}", "", {"invalid_tool_call": 1}),
        (f"{START}", "", {"invalid_tool_call": 1}),
        (f"[f(a=1{START}[{WEATHER}]", "[f(a=1", {"invalid_tool_call": 1}),
        (f"[f(a=1{END} rest", "[f(a=1 rest", {"invalid_tool_call": 1}),
        (f"{START}[{WEATHER}, {END} rest", " rest", {"unclosed_call": 1}),  # the calls stand
        (f"[{WEATHER}]{END}", "", {"unknown_tag": 1}),  # no python block open
        (f"text{END} more", "text more", {"unknown_tag": 1}),
        (f"[{WEATHER}", "", {"unclosed_call": 1}),  # the model ended before "]"
        (f"[{WEATHER}, ", "", {"unclosed_call": 1}),
        ("[f(a=1", "[f(a=1", {"invalid_tool_call": 1}),  # ended inside a call
        ("[f", "[f", {}),
    ],
)
def test_llama4_tags_and_ends(text: str, content: str, recoveries: dict[str, int]) -> None:
    answer, found = parsed(text)
    assert (answer.content, found) == (content, recoveries)


def test_without_declared_tools_a_list_is_content_and_with_tools_disabled_calls_are_dropped() -> None:
    answer, recoveries = parsed(f"[{WEATHER}]", tools_declared=False)
    assert (answer.content, answer.tool_calls, recoveries) == (f"[{WEATHER}]", [], {})
    answer, recoveries = parsed(f"[{WEATHER}, {SEARCH}]", tools_enabled=False)
    assert (answer.content, answer.tool_calls, recoveries) == ("", [], {"tool_call_not_allowed": 2})


COMPLETION = f"{START}[{WEATHER}, {SEARCH}]{END}\n\nDone 😀."


@pytest.mark.parametrize("parser", ["pythonic", "llama4_pythonic"])
def test_a_max_tokens_cut_at_every_position(parser: str) -> None:
    """No error, no half call, nothing counted; the answer is a prefix of the whole, and streamed id by
    id no released content is taken back."""
    family = "llama4" if parser == "llama4_pythonic" else "llama3"
    ids = ids_of(
        COMPLETION if parser == "llama4_pythonic" else COMPLETION.replace(START, "").replace(END, ""), family
    )
    full = every_cut_is_a_prefix(make(parser), ids)
    assert (full.content, calls(full)) == ("\n\nDone 😀.", [WEATHER_CALL, SEARCH_CALL])


def test_each_call_is_released_when_its_parentheses_close() -> None:
    text = f"[{WEATHER}, {SEARCH}]"
    ids = ids_of(text)
    parser = make()()
    released = [at for at, token_id in enumerate(ids) for _ in parser.feed([token_id])]
    decoded = [len(tokenizer("llama4").decode(ids[: at + 1])) for at in range(len(ids))]
    ends = [text.index(WEATHER) + len(WEATHER), text.index(SEARCH) + len(SEARCH)]
    assert released == [next(at for at, size in enumerate(decoded) if size >= end) for end in ends]


def test_a_long_string_is_released_whole_when_it_closes() -> None:
    """A 30k-character string full of escaped quotes and brackets: nothing before the last id."""
    call = "[f(s='" + "ab\\'c)] " * 5000 + "')]"
    ids = ids_of(call)
    parser = make()()
    released = [(at, d) for at, token_id in enumerate(ids) for d in parser.feed([token_id])]
    assert parser.finish("stop") == []
    [(at, delta)] = released
    assert isinstance(delta, ToolCallDelta) and at >= len(ids) - 2
    assert json.loads(delta.arguments)["s"].startswith("ab'c)] ab'c")


# -- the literal reader against Python's own ------------------------------------------------------

IDENTIFIERS = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda name: name not in {"if", "in", "is", "as", "or", "and", "not", "for", "def", "del", "try"}
)
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=4) | st.integers(0, 5), children, max_size=3)
    ),  # -1 is no constant
    max_leaves=8,
)


def python_text(value: Any, rng: random.Random) -> str:
    """``value`` as Python source, spelled one of several ways."""
    if isinstance(value, list):
        trailing = rng.choice(["", ","]) if value else ""
        return "[" + ", ".join(python_text(item, rng) for item in value) + trailing + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(python_text(item, rng) for item in value) + ",)"
    if isinstance(value, dict):
        items = (f"{python_text(k, rng)}: {python_text(v, rng)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, str):
        spelled = repr(value)
        return rng.choice(
            [
                spelled,
                json.dumps(value, ensure_ascii=False),
                "r" + spelled if "\\" not in spelled else spelled,
            ]
        )
    return repr(value)


def jsonable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


@settings(max_examples=300, deadline=None)
@given(arguments=st.dictionaries(IDENTIFIERS, VALUES, max_size=4), seed=st.integers(0, 1000))
def test_the_reader_agrees_with_ast_literal_eval(arguments: dict[str, Any], seed: int) -> None:
    """Generated calls read the same as Python reads their literals; their close is found piece by piece."""
    rng = random.Random(seed)
    texts = {key: python_text(value, rng) for key, value in arguments.items()}
    source = "f(" + ", ".join(f"{key}={text}" for key, text in texts.items()) + ")"
    expected = {key: jsonable(ast.literal_eval(text)) for key, text in texts.items()}
    name, found, _ = parse_call(source)
    assert name == "f"
    assert json.loads(found) == json.loads(json.dumps(expected, ensure_ascii=False))
    cut = rng.randrange(2, len(source))
    end = ArgumentsEnd()
    assert (end.feed(source[2:cut]), end.feed(source[cut:])) == (OPEN, len(source) - cut)


@pytest.mark.parametrize(
    ("pieces", "found"),
    [
        (["a=')'", ")"], [OPEN, 1]),
        (["a='''", "x'", "'", "'", ")"], [OPEN, OPEN, OPEN, OPEN, 1]),  # a triple quote closed piece by piece
        (["a=''", ")"], [OPEN, 1]),  # an empty string, then the close
        (["a='\\", "')", "')"], [OPEN, OPEN, 2]),  # an escape across pieces
        (["a=']')"], [6]),
        (["a=1])"], [REFUSED]),  # a bracket closes the call
        (["a='x\n')"], [REFUSED]),
        (["a=" + "[" * (MAX_NESTING - 1)], [OPEN]),
        (["a=" + "[" * MAX_NESTING], [REFUSED]),
    ],
)
def test_where_the_arguments_close_piece_by_piece(pieces: list[str], found: list[int]) -> None:
    end = ArgumentsEnd()
    assert [end.feed(piece) for piece in pieces] == found


def test_the_reader_refuses_what_it_cannot_hold_and_reads_long_runs_in_one_pass() -> None:
    for text in ["f(a='" + "\\N{" * 1000 + "')", "f(a=1" + "0" * 5000 + ")"]:
        with pytest.raises(NotACallError):
            parse_call(text)
    assert parse_call("f(a=" + "-" * 10_000 + "1)").arguments == '{"a":1}'  # signs are a loop, not nesting
    assert parse_call("f(" + "a" * 100_000 + "=1)").arguments == '{"' + "a" * 100_000 + '":1}'


FUZZ_PIECES = (
    *("[", "]", "(", ")", "{", "}", "'", '"', "'''", '"""', "\\", "\\'", ",", ", ", "=", ":", "-", "."),
    *(" ", "\n", "\r\n", "\t", "f", "f(", "get_weather", "a=", "b = ", "1", "2.5e3", "0x1f", "None", "true"),
    *("x", "r'", "b'", "f'", "#", "你", "😀", START, END, EOM, f"[{WEATHER}]", f"{SEARCH}, ", "[f(a="),
)


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(FUZZ_PIECES), max_size=40),
    parser=st.sampled_from(["pythonic", "llama4_pythonic"]),
    finish=st.sampled_from(["stop", "length"]),
)
def test_any_output_parses_the_same_whole_and_streamed_and_loses_nothing(
    pieces: list[str], parser: str, finish: str
) -> None:
    """Random pythonic-looking output: never an error, whole = streamed = chunked, every call whole
    with JSON arguments; an output without calls, tags or recoveries is its content, as written."""
    answer, recoveries = parsed("".join(pieces), finish, parser=parser)
    for call in answer.tool_calls:
        assert isinstance(json.loads(call.arguments), dict) and call.name
    text = "".join(pieces).replace(EOM, "")
    if (
        finish == "stop"
        and not answer.tool_calls
        and not recoveries
        and START not in text
        and END not in text
    ):
        assert answer.content == text
