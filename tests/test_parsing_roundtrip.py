"""The K3 parser inverts the K3 renderer: an assistant turn rendered by the real ``KimiK3Formatter``
parses back to the same message, and that message, sent back in a follow-up request, renders the
same prompt as the original history."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import given, settings
from hypothesis import strategies as st
from support.parsers import all_ways, counting_ids
from test_parsing_streams import K3, card, tokenizer

from dynamo_prep.formatter import KimiK3Formatter, Segment
from dynamo_prep.formatter.kimi_k3 import END_OF_MSG, OPEN, SEP
from dynamo_prep.parsing import ParsedAnswer, ToolCallDelta, answer_parser_for, assistant_message

FORMATTER = KimiK3Formatter()
SPELLINGS = (
    "<|close|>argument<|sep|>",
    '<|open|>call tool="x" index="1"<|sep|>',
    "<|close|>think<|sep|>",
    "<|end_of_msg|>",
    "&quot;",
    "&amp;",
    '"',
    "你好",
    "😀",
    " ",
    "\n",
)
ASSISTANT_HEAD = [
    Segment(OPEN, True),
    Segment("message", False),
    Segment(" role", False),
    Segment('="', False),
    Segment("assistant", False),
    Segment('"', False),
    Segment(SEP, True),
]

texts = st.lists(st.text(max_size=10) | st.sampled_from(SPELLINGS), max_size=4).map("".join)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return bool(text.strip())
    return False


raw_arguments = texts.filter(_not_json)
argument_dicts = st.dictionaries(texts, json_values, max_size=4)


@dataclass
class Case:
    form: Literal["think", "response", "hosted"]
    reasoning: str
    content: str | None
    calls: list[tuple[str, Any]]  # (name, arguments: a dict, a JSON string of one, or raw text)


cases = st.builds(
    Case,
    form=st.sampled_from(["think", "response", "hosted"]),
    reasoning=texts,
    content=st.none() | texts,
    calls=st.lists(
        st.tuples(texts, argument_dicts | argument_dicts.map(json.dumps) | raw_arguments | st.none()),
        max_size=3,
    ),
)


def original_message(case: Case) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": case.content,
        "reasoning_content": case.reasoning,
    }
    if case.calls:
        message["tool_calls"] = [
            {"id": f"orig_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for k, (name, arguments) in enumerate(case.calls)
        ]
    return message


def expected_arguments(arguments: Any) -> str:
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        if _not_json(arguments):
            return arguments
        arguments = json.loads(arguments)
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def rendered_turn(case: Case, thinking: bool) -> list[Segment]:
    """The segments the model writes after the prompt: the rendered turn after its prompt part."""
    segments = FORMATTER.render_segments(
        [{"role": "user", "content": "q"}, original_message(case)],
        add_generation_prompt=False,
        thinking=thinking,
    )
    head = max(i for i in range(len(segments)) if segments[i : i + len(ASSISTANT_HEAD)] == ASSISTANT_HEAD)
    start = head + len(ASSISTANT_HEAD) + (0 if case.form == "hosted" else 3)
    assert segments[-1] == Segment(END_OF_MSG, True)
    return segments[start:]


def follow_up_ids(assistant: dict[str, Any], call_ids: list[str], thinking: bool) -> list[int]:
    results = [
        {"role": "tool", "tool_call_id": call_id, "content": f"result {k}"}
        for k, call_id in enumerate(call_ids)
    ]
    messages = [
        {"role": "user", "content": "q"},
        assistant,
        *reversed(results),
        {"role": "user", "content": "next"},
    ]
    return tokenizer(K3).encode_segments(FORMATTER.render_segments(messages, thinking=thinking))


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(cases)
def test_a_rendered_turn_parses_back_and_renders_the_same_follow_up(case: Case) -> None:
    thinking = case.form != "response"
    ids = tokenizer(K3).encode_segments(rendered_turn(case, thinking))
    make = lambda: answer_parser_for(  # noqa: E731
        card(K3),
        tokenizer(K3),
        thinking=thinking,
        prompt_form="hosted" if case.form == "hosted" else "reference",
        call_ids=counting_ids(),
    )
    answer, recoveries = all_ways(make, ids, seeds=(len(ids),))

    reasoning = case.reasoning if thinking and case.reasoning.strip() else ""
    calls = [(name, expected_arguments(arguments)) for name, arguments in case.calls]
    assert (answer.reasoning, answer.content) == (reasoning, case.content or "")
    assert [(call.name, call.arguments) for call in answer.tool_calls] == calls
    raw_blocks = sum(isinstance(a, str) and _not_json(a) for _, a in case.calls)
    assert recoveries == ({"invalid_json_block": raw_blocks} if raw_blocks else {})

    parsed_ids = [call.id for call in answer.tool_calls]
    original_ids = [f"orig_{k}" for k in range(len(case.calls))]
    assert follow_up_ids(assistant_message(answer), parsed_ids, thinking) == follow_up_ids(
        original_message(case), original_ids, thinking
    )


def test_the_round_trip_of_a_known_turn() -> None:
    """One concrete instance of the property, readable on its own."""
    case = Case(
        form="think",
        reasoning="Use the tool.",
        content=None,
        calls=[("get_weather", {"city": "Paris <|close|>argument<|sep|>", "days": 3, "opts": {"unit": "C"}})],
    )
    ids = tokenizer(K3).encode_segments(rendered_turn(case, thinking=True))
    make = lambda: answer_parser_for(card(K3), tokenizer(K3), thinking=True, call_ids=counting_ids())  # noqa: E731
    answer, recoveries = all_ways(make, ids)
    arguments = '{"city":"Paris <|close|>argument<|sep|>","days":3,"opts":{"unit":"C"}}'
    assert answer == ParsedAnswer(
        reasoning="Use the tool.",
        content="",
        tool_calls=[ToolCallDelta(0, "call_0", "get_weather", arguments)],
    )
    assert recoveries == {}
