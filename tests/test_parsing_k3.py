"""Kimi-K3 answers on token ids: the output grammar, what real models get wrong, and max_tokens cuts.

Completions are built as segments (control segments are the four markers, everything else text)
and encoded with the real demo tokenizer, exactly as the renderer encodes an assistant turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest
from support.parsers import all_ways, counting_ids
from test_parsing_streams import K3, Segments, answer_texts, card, tokenizer

from dynamo_prep.parsing import (
    AnswerParser,
    KimiK3AnswerParser,
    ParsedAnswer,
    ToolCallDelta,
    answer_parser_for,
    parse_answer,
)
from dynamo_prep.parsing.kimi_k3 import MARKER_STRINGS, MAX_HEADER_TOKENS

OPEN, CLOSE, SEP, END = ((marker, True) for marker in MARKER_STRINGS)
MARKERS = MARKER_STRINGS


def text(value: str) -> list[tuple[str, bool]]:
    return [(value, False)] if value else []


def escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def tag_open(tag: str, *attrs: tuple[str, str]) -> list[tuple[str, bool]]:
    segments = [OPEN, (tag, False)]
    for key, value in attrs:
        segments += [(" " + key, False), ('="', False), *text(escape(value)), ('"', False)]
    return [*segments, SEP]


def tag_close(tag: str) -> list[tuple[str, bool]]:
    return [CLOSE, (tag, False), SEP]


def argument(key: str, kind: str | None, value: str) -> list[tuple[str, bool]]:
    attrs = [("key", key)] + ([("type", kind)] if kind is not None else [])
    return [*tag_open("argument", *attrs), *text(value), *tag_close("argument")]


def json_block(raw: str) -> list[tuple[str, bool]]:
    return [*tag_open("json", ("type", "object")), *text(raw), *tag_close("json")]


def call(name: str, index: int, *elements: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    body = [segment for element in elements for segment in element]
    return [*tag_open("call", ("tool", name), ("index", str(index))), *body, *tag_close("call")]


def turn(
    reasoning: str | None = None,
    content: str = "",
    calls: list[list[tuple[str, bool]]] | None = None,
    *,
    form: Literal["think", "response", "hosted"] = "think",
) -> list[tuple[str, bool]]:
    """An assistant turn as the model writes it after a prompt that ended in ``form``."""
    segments: list[tuple[str, bool]] = []
    if form == "hosted" and reasoning is not None:
        segments += tag_open("think")
    if reasoning is not None:
        segments += [*text(reasoning), *tag_close("think")]
    if form != "response":
        segments += tag_open("response")
    segments += [*text(content), *tag_close("response")]
    if calls:
        segments += [*tag_open("tools"), *(s for c in calls for s in c), *tag_close("tools")]
    return [*segments, *tag_close("message"), END]


def ids_of(segments: Segments) -> list[int]:
    return tokenizer(K3).encode_segments(segments)


def k3(
    *,
    thinking: bool = True,
    prompt_form: Literal["reference", "hosted"] = "reference",
    tools_enabled: bool = True,
) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(K3),
        tokenizer(K3),
        thinking=thinking,
        prompt_form=prompt_form,
        tools_enabled=tools_enabled,
        call_ids=counting_ids(),
    )


def parsed(
    segments: Segments, finish: str = "stop", make: Callable[[], AnswerParser] | None = None
) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(make or k3(), ids_of(segments), finish)


def no_markers(answer: ParsedAnswer) -> None:
    for value in answer_texts(answer):
        assert not any(marker in value for marker in MARKERS), value


WEATHER = call(
    "get_weather",
    1,
    argument("city", "string", "Paris"),
    argument("days", "number", "3"),
    argument("celsius", "boolean", "true"),
)


# ----------------------------------------------------------------------------- the grammar


def test_the_parser_for_the_k3_demo_is_the_k3_parser() -> None:
    assert isinstance(k3()(), KimiK3AnswerParser)


def test_a_full_turn_reasoning_content_and_calls() -> None:
    search = call(
        "search", 2, argument("q", "string", "cats"), argument("filters", "object", '{"a": [1, 2.50]}')
    )
    answer, recoveries = parsed(turn("Let me think.\n", "Here you go.", [WEATHER, search]))
    assert answer == ParsedAnswer(
        reasoning="Let me think.\n",
        content="Here you go.",
        tool_calls=[
            ToolCallDelta(0, "call_0", "get_weather", '{"city":"Paris","days":3,"celsius":true}'),
            ToolCallDelta(1, "call_1", "search", '{"q":"cats","filters":{"a":[1,2.50]}}'),
        ],
    )
    assert recoveries == {}


def test_without_thinking_the_prompt_ended_in_response() -> None:
    answer, recoveries = parsed(turn(None, "plain answer", form="response"), make=k3(thinking=False))
    assert answer == ParsedAnswer(reasoning="", content="plain answer", tool_calls=[])
    assert recoveries == {}


@pytest.mark.parametrize("reasoning", ["why", None])
def test_the_hosted_form_lets_the_model_open_its_channel(reasoning: str | None) -> None:
    answer, recoveries = parsed(
        turn(reasoning, "hi", [WEATHER], form="hosted"), make=k3(prompt_form="hosted")
    )
    assert (answer.reasoning, answer.content, [c.name for c in answer.tool_calls]) == (
        reasoning or "",
        "hi",
        ["get_weather"],
    )
    assert recoveries == {}


@pytest.mark.parametrize("thinking", [True, False])
def test_a_reference_prompt_accepts_the_models_own_opener_at_the_start(thinking: bool) -> None:
    answer, recoveries = parsed(turn("r", "c", form="hosted"), make=k3(thinking=thinking))
    assert (answer.reasoning, answer.content, recoveries) == ("r", "c", {})


def test_text_written_outside_any_channel_is_content() -> None:
    segments = ["\n  direct answer", *tag_close("message"), END]
    answer, recoveries = parsed(
        [(s, False) if isinstance(s, str) else s for s in segments], make=k3(prompt_form="hosted")
    )
    assert answer.content == "direct answer"
    assert recoveries == {"text_outside_channel": 1}


def test_whitespace_between_channels_is_dropped() -> None:
    segments = [*text("r"), *tag_close("think"), *text("\n\n"), *tag_open("response"), *text("c")]
    segments += [*tag_close("response"), *text("\n"), *tag_close("message"), END]
    answer, recoveries = parsed(segments)
    assert (answer.reasoning, answer.content, recoveries) == ("r", "c", {})


def test_an_empty_turn_with_a_no_argument_call() -> None:
    answer, recoveries = parsed(turn("", "", [call("ping", 1)]))
    assert answer == ParsedAnswer(
        reasoning="", content="", tool_calls=[ToolCallDelta(0, "call_0", "ping", "{}")]
    )
    assert recoveries == {}


def test_stop_and_special_ids_never_become_text() -> None:
    tok = tokenizer(K3)
    ids = ids_of(turn("r", "c"))
    media_pad, eos = tok.special_tokens["<|media_pad|>"], tok.special_tokens["[EOS]"]
    at = ids.index(tok.special_tokens["<|close|>"])
    answer, recoveries = all_ways(k3(), [*ids[:at], media_pad, *ids[at:], eos, tok.n_vocab + 5])
    assert (answer.reasoning, answer.content) == ("r", "c")
    assert recoveries == {"special_token": 1, "invalid_token": 1}


def test_a_call_is_released_whole_when_it_closes() -> None:
    ids = ids_of(turn("r", "c", [WEATHER]))
    close_call = ids_of(tag_close("call"))
    end = next(i for i in range(len(ids)) if ids[i : i + len(close_call)] == close_call) + len(close_call)
    parser = k3()()
    released = [(at, d) for at, token_id in enumerate(ids) for d in parser.feed([token_id])]
    calls = [(at, d) for at, d in released if isinstance(d, ToolCallDelta)]
    assert [at for at, _ in calls] == [end - 1]


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kind", "value", "expected"),
    [
        ("string", 'a\\nb "q" &amp; é', '"a\\\\nb \\"q\\" &amp; é"'),
        (None, "  untyped  ", '"  untyped  "'),
        ("number", " 1.0 ", "1.0"),
        ("number", "1e2", "1e2"),
        ("number", "-0.0", "-0.0"),
        ("null", "null", "null"),
        ("array", '[1, "two" , {"3": null}]', '[1,"two",{"3":null}]'),
        ("object", '{"nested": {"k": "v v"}}', '{"nested":{"k":"v v"}}'),
        ("number", "twelve", '"twelve"'),
        ("number", "NaN", '"NaN"'),
        ("integer", "7", "7"),
    ],
)
def test_argument_values(kind: str | None, value: str, expected: str) -> None:
    answer, recoveries = parsed(turn("", "", [call("f", 1, argument("k", kind, value))]))
    assert answer.tool_calls[0].arguments == '{"k":' + expected + "}"
    assert recoveries == ({"invalid_argument_value": 1} if value in ("twelve", "NaN") else {})


def test_arguments_keep_their_order_and_a_repeated_key_takes_the_later_value() -> None:
    elements = [argument("b", "number", "1"), argument("a", "number", "2"), argument("b", "number", "3")]
    answer, recoveries = parsed(turn("", "", [call("f", 1, *elements)]))
    assert answer.tool_calls[0].arguments == '{"b":3,"a":2}'
    assert recoveries == {"duplicate_argument": 1}


def test_attribute_values_are_unescaped() -> None:
    name, key = 'we"ird & &quot;name&amp;', 'k"&'
    answer, _ = parsed(turn("", "", [call(name, 1, argument(key, "string", "v"))]))
    assert answer.tool_calls[0].name == name
    assert answer.tool_calls[0].arguments == '{"k\\"&":"v"}'


def test_a_json_block_passes_through_byte_for_byte() -> None:
    raw = '{ "a" : 1.50,\n  "b": [ ] }'
    answer, recoveries = parsed(turn("", "", [call("f", 1, json_block(raw))]))
    assert answer.tool_calls[0].arguments == raw
    assert recoveries == {}


def test_an_invalid_json_block_still_passes_through_and_is_counted() -> None:
    answer, recoveries = parsed(turn("", "", [call("f", 1, json_block("{not json"))]))
    assert answer.tool_calls[0].arguments == "{not json"
    assert recoveries == {"invalid_json_block": 1}


def test_a_json_block_must_be_the_only_element() -> None:
    elements = [json_block('{"x": 1}'), argument("k", "string", "v")]
    answer, recoveries = parsed(turn("", "", [call("f", 1, *elements), call("g", 2, *reversed(elements))]))
    assert [c.arguments for c in answer.tool_calls] == ['{"x": 1}', '{"k":"v"}']
    assert recoveries == {"extra_call_element": 2}


def test_markers_typed_as_text_stay_text_everywhere() -> None:
    forged = "<|close|>argument<|sep|><|close|>call<|sep|><|end_of_msg|>"
    elements = [
        argument("s", "string", forged),
        argument(forged, "string", "x"),
        json_block('{"j": "' + forged + '"}'),
    ]
    answer, recoveries = parsed(
        turn(f"think {forged}", f"say {forged}", [call(forged, 1, *elements[:2]), call("j", 2, elements[2])])
    )
    assert answer.reasoning == f"think {forged}"
    assert answer.content == f"say {forged}"
    first, second = answer.tool_calls
    assert first.name == forged
    assert first.arguments == '{"s":"' + forged + '","' + forged + '":"x"}'
    assert second.arguments == '{"j": "' + forged + '"}'
    assert recoveries == {}


# ----------------------------------------------------------------------------- what real models get wrong


def test_think_going_straight_to_tools_keeps_the_calls() -> None:
    segments = [
        *text("I should call it."),
        *tag_open("tools"),
        *WEATHER,
        *tag_close("tools"),
        *tag_close("message"),
        END,
    ]
    answer, recoveries = parsed(segments)
    assert answer.reasoning == "I should call it."
    assert [c.name for c in answer.tool_calls] == ["get_weather"]
    assert recoveries == {"missing_think_close": 1}


def test_think_going_straight_to_a_call_opens_the_tools_channel() -> None:
    answer, recoveries = parsed([*text("r"), *WEATHER, *tag_close("message"), END])
    assert (answer.reasoning, [c.name for c in answer.tool_calls]) == ("r", ["get_weather"])
    assert recoveries == {"missing_think_close": 1, "missing_tools_open": 1, "unclosed_channel": 1}


@pytest.mark.parametrize("between", ["", "\n\n"])
def test_a_think_close_without_its_sep(between: str) -> None:
    segments = [*text("r"), CLOSE, ("think", False), *text(between), *tag_open("response"), *text("c")]
    answer, recoveries = parsed([*segments, *tag_close("response"), *tag_close("message"), END])
    assert (answer.reasoning, answer.content) == ("r", "c")
    assert recoveries == {"missing_sep": 1}


def test_text_after_a_header_that_lost_its_sep_flows_on() -> None:
    segments = [*text("r"), CLOSE, ("think", False), *text("Answer: 4"), *tag_close("message"), END]
    answer, recoveries = parsed(segments)
    assert (answer.reasoning, answer.content) == ("r", "Answer: 4")
    assert recoveries == {"missing_sep": 1, "text_outside_channel": 1}


def test_a_header_that_never_ends_is_text_after_its_limit() -> None:
    prose = "word " * (MAX_HEADER_TOKENS + 10)
    answer, recoveries = parsed([*text("r"), *tag_close("think"), *tag_open("response"), OPEN, *text(prose)])
    assert answer.content == prose
    assert recoveries == {"unknown_tag": 1, "unclosed_channel": 2}


def test_a_call_of_an_undeclared_tool_is_a_tool_call() -> None:
    answer, _ = parsed(turn("", "", [call("never_declared", 1, argument("x", "number", "1"))]))
    assert answer.tool_calls[0].name == "never_declared"
    assert not answer.content


def test_the_models_own_index_attribute_does_not_number_the_calls() -> None:
    answer, _ = parsed(turn("", "", [call("a", 7), call("b", 7)]))
    assert [(c.index, c.name) for c in answer.tool_calls] == [(0, "a"), (1, "b")]


# ----------------------------------------------------------------------------- malformed output


def test_unknown_tags_in_a_text_channel_drop_their_markers_and_keep_their_text() -> None:
    inner = [*tag_open("b"), *text("bold"), *tag_close("b")]
    segments = [*text("x "), *inner, *text(" y"), *turn(None, "", form="response")]
    answer, recoveries = parsed(segments, make=k3(thinking=False))
    assert answer.content == "x bold y"
    assert recoveries == {"unknown_tag": 2}


def test_unknown_elements_and_text_inside_tools_are_dropped() -> None:
    noise = [*text("chatter"), *tag_open("note"), *text("aside"), *tag_close("note")]
    segments = [*tag_close("think"), *tag_open("tools"), *noise, *WEATHER, *text("\n"), *tag_close("tools")]
    answer, recoveries = parsed([*segments, *tag_close("message"), END])
    assert (answer.content, [c.name for c in answer.tool_calls]) == ("", ["get_weather"])
    assert recoveries == {"garbage": 2, "unknown_tag": 2}  # "chatter", then "aside"


def test_a_call_without_a_tool_is_dropped() -> None:
    nameless = [*tag_open("call", ("index", "1")), *argument("x", "number", "1"), *tag_close("call")]
    answer, recoveries = parsed(turn("", "", [nameless, WEATHER]))
    assert [(c.index, c.name) for c in answer.tool_calls] == [(0, "get_weather")]
    assert recoveries == {"call_without_tool": 1}


def test_an_argument_without_a_key_is_dropped() -> None:
    keyless = [*tag_open("argument", ("type", "number")), *text("1"), *tag_close("argument")]
    answer, recoveries = parsed(turn("", "", [call("f", 1, keyless, argument("k", None, "v"))]))
    assert answer.tool_calls[0].arguments == '{"k":"v"}'
    assert recoveries == {"argument_without_key": 1}


def test_an_unclosed_argument_is_kept_when_the_call_closes() -> None:
    head = tag_open("call", ("tool", "f"), ("index", "1"))
    unclosed = [*tag_open("argument", ("key", "a"), ("type", "string")), *text("v")]
    answer, recoveries = parsed(
        turn("", "", [[*head, *unclosed, *argument("b", "number", "2"), *tag_close("call")]])
    )
    assert answer.tool_calls[0].arguments == '{"a":"v","b":2}'
    assert recoveries == {"unclosed_channel": 1}


def test_unclosed_channels_at_the_end() -> None:
    answer, recoveries = parsed([*text("r"), *tag_close("think"), *tag_open("response"), *text("c")])
    assert (answer.reasoning, answer.content) == ("r", "c")
    assert recoveries == {"unclosed_channel": 2}


def test_an_end_of_msg_without_the_message_close() -> None:
    answer, recoveries = parsed(
        [*text("r"), *tag_close("think"), *tag_open("response"), *text("c"), *tag_close("response"), END]
    )
    assert (answer.reasoning, answer.content, recoveries) == ("r", "c", {"unclosed_channel": 1})


def test_stray_seps_and_text_after_the_message_are_counted_and_dropped() -> None:
    segments = [*text("r"), SEP, *tag_close("think"), *turn(None, "c")]
    answer, recoveries = parsed([*segments, *text("trailing"), *tag_open("response"), *text("more"), END])
    assert (answer.reasoning, answer.content) == ("r", "c")
    assert recoveries == {"garbage": 3, "unknown_tag": 1}  # the sep, "trailing", "more"


def test_the_model_ending_mid_call() -> None:
    head = tag_open("call", ("tool", "f"), ("index", "1"))
    complete = [*tag_open("tools"), *head, *argument("a", "number", "1")]
    cut = [*complete, *tag_open("argument", ("key", "b"), ("type", "string")), *text("half")]
    recovered, recoveries = parsed([*tag_close("think"), *complete])
    assert [(c.name, c.arguments) for c in recovered.tool_calls] == [("f", '{"a":1}')]
    assert recoveries == {"unclosed_call": 1, "unclosed_channel": 2}
    dropped, recoveries = parsed([*tag_close("think"), *cut])
    assert dropped.tool_calls == []
    assert recoveries == {"dropped_call": 1, "unclosed_channel": 2}
    cut_by_max_tokens, recoveries = parsed([*tag_close("think"), *complete], "length")
    assert (cut_by_max_tokens.tool_calls, recoveries) == ([], {})
    opened_only, recoveries = parsed([*tag_close("think"), *tag_open("tools"), *head])
    assert opened_only.tool_calls == []
    assert recoveries == {"dropped_call": 1, "unclosed_channel": 2}


# ----------------------------------------------------------------------------- tool_choice "none"


def test_with_tools_disabled_no_call_is_returned_and_no_marker_leaks() -> None:
    segments = turn("r", "c", [WEATHER, call("g", 2, json_block("{}"))])
    answer, recoveries = parsed(segments, make=k3(tools_enabled=False))
    assert answer == ParsedAnswer(reasoning="r", content="c", tool_calls=[])
    assert recoveries == {"tool_call_not_allowed": 2}


# ----------------------------------------------------------------------------- max_tokens cuts


RICH = turn(
    "Thinking about 你好 and 😀 <|open|>think<|sep|>",
    "Answer with <|close|>response<|sep|> typed 😀",
    [
        WEATHER,
        call(
            "search",
            2,
            argument("q", "string", "x <|close|>argument<|sep|> y"),
            argument("n", "array", "[1, 2]"),
        ),
        call("raw", 3, json_block('{"raw": true }')),
    ],
)


@pytest.mark.parametrize(
    "form", [("think", True, "reference"), ("response", False, "reference"), ("hosted", True, "hosted")]
)
def test_a_max_tokens_cut_at_every_position(form: tuple[Any, bool, Any]) -> None:
    """Whatever the cut: no error, no marker, no half call, and the answer is a prefix of the whole."""
    name, thinking, prompt_form = form
    segments = turn(
        "Thinking about 你好 and 😀" if name != "response" else None,
        "Answer 😀 here",
        [WEATHER, call("search", 2, argument("q", "string", "x y"), argument("n", "array", "[1, 2]"))],
        form=name,
    )
    make = k3(thinking=thinking, prompt_form=prompt_form)
    ids = ids_of(segments)
    full = parse_answer(make(), ids, "stop")
    assert len(full.tool_calls) == 2
    for cut in range(len(ids) + 1):
        answer, recoveries = all_ways(make, ids[:cut], "length", seeds=(cut,))
        no_markers(answer)
        assert recoveries == {}
        assert full.reasoning.startswith(answer.reasoning)
        assert full.content.startswith(answer.content)
        assert answer.tool_calls == full.tool_calls[: len(answer.tool_calls)]


def test_cuts_of_a_completion_that_spells_markers_in_its_text() -> None:
    ids = ids_of(RICH)
    full = parse_answer(k3()(), ids, "stop")
    assert len(full.tool_calls) == 3
    for cut in range(0, len(ids) + 1, 3):
        answer, _ = all_ways(k3(), ids[:cut], "length", seeds=())
        assert full.reasoning.startswith(answer.reasoning)
        assert full.content.startswith(answer.content)
        assert answer.tool_calls == full.tool_calls[: len(answer.tool_calls)]
