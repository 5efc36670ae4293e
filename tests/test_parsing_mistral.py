"""Mistral tool calls and reasoning (``mistral``) on real Mistral vocabularies (tests/support/hf_models):
``[TOOL_CALLS]`` + a JSON array on the pre-v11 SentencePiece (v3, v7) and tekken (Nemo) vocabularies,
``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` and ``[THINK]...[/THINK]`` on Mistral Small 3.2's. Markers
are control tokens matched on their ids; calls are released whole with Mistral's 9-character ids;
whatever is no call stays content, counted."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids, every_cut_is_a_prefix

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.formatter.jinja import JinjaFormatter
from dynamo_prep.parsing import (
    AnswerParser,
    ParsedAnswer,
    answer_parser_for,
    assistant_message,
    call_ids_for,
    parse_answer,
)
from dynamo_prep.protocol.openai import ChatCompletionRequest
from dynamo_prep.tokenizer import Tokenizer

V11 = "mistral_small_3"  # tekken with [ARGS], [CALL_ID], [THINK], [/THINK]
PRE_V11 = ("mistral_v3", "mistral_v7", "mistral_nemo")  # [TOOL_CALLS] only
_MARKERS = re.compile(r"(\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\]|\[THINK\]|\[/THINK\]|</s>)")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
SEARCH = '{"name": "search", "arguments": {"q": "cats 你好 😀", "n": 1.0}}'
SEARCH_CALL = ("search", {"q": "cats 你好 😀", "n": 1.0})


@cache
def directory(model: str) -> Path:
    return built_models()[model]


@cache
def tokenizer(model: str) -> Tokenizer:
    return Tokenizer.from_model_dir(directory(model))


@cache
def card(model: str, reasoning: bool = True) -> ModelDeploymentCard:
    runtime = ModelRuntimeConfig(
        tool_call_parser="mistral", reasoning_parser="mistral" if reasoning else None
    )
    return ModelDeploymentCard.from_model_dir(directory(model), runtime_config=runtime)


def mistral(model: str = V11, *, tools_enabled: bool = True, ids: bool = True) -> Callable[[], AnswerParser]:
    return lambda: answer_parser_for(
        card(model),
        tokenizer(model),
        thinking=False,
        tools_enabled=tools_enabled,
        call_ids=counting_ids() if ids else None,
    )


def ids_of(text: str, model: str = V11) -> list[int]:
    """``text`` as the model writes it: each control token its id where the vocabulary has it."""
    tok = tokenizer(model)
    pieces = [piece for piece in _MARKERS.split(text) if piece]
    return tok.encode_segments([(piece, tok.is_special_token(piece)) for piece in pieces])


def parsed(
    text: str, model: str = V11, finish: str = "stop", **options: bool
) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(mistral(model, **options), ids_of(text, model), finish)


def calls(answer: ParsedAnswer) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


def test_the_registry_builds_both_halves_for_the_declared_names() -> None:
    assert mistral()().family == "mistral"  # one name for both halves
    tok = tokenizer(V11)
    assert all(
        tok.special_tokens.get(m) == tok.added_tokens[m] for m in ("[TOOL_CALLS]", "[ARGS]", "[THINK]")
    )
    assert "[ARGS]" not in tokenizer("mistral_nemo").added_tokens


# ----------------------------------------------------------------------------- the JSON form


@pytest.mark.parametrize("model", [*PRE_V11, V11])
@pytest.mark.parametrize(
    "text",
    [
        f"[TOOL_CALLS][{WEATHER}, {SEARCH}]",
        f"[TOOL_CALLS] [{WEATHER},\n {SEARCH}]</s>",
        f"[TOOL_CALLS]{WEATHER}[TOOL_CALLS][{SEARCH}]",  # a bare object; each marker opens calls
    ],
)
def test_the_json_form(model: str, text: str) -> None:
    answer, recoveries = parsed(text, model)
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL, SEARCH_CALL], {})
    assert [call.index for call in answer.tool_calls] == [0, 1]


@pytest.mark.parametrize("model", PRE_V11)
def test_text_before_and_after_the_calls_is_content(model: str) -> None:
    answer, recoveries = parsed(f"Let me look. [TOOL_CALLS][{WEATHER}]\n\nDone 你好.", model)
    assert (answer.content.strip(), calls(answer), recoveries) == (
        "Let me look. \n\nDone 你好.",
        [WEATHER_CALL],
        {},
    )
    answer, _ = parsed(f"[TOOL_CALLS][{WEATHER}]  \n ", model)
    assert answer.content == ""  # whitespace alone after the calls is dropped


def test_json_form_arguments_keep_the_models_spelling() -> None:
    arguments = '{"x": 1e2, "s": "}{\\"\\u00e9 ]", "n": {"a": [1, {"b": 2.50}]}}'
    body = f'[{{"name": "f", "arguments": {arguments}, "id": "abc123XYZ"}}]'
    answer, _ = parsed(f"[TOOL_CALLS]{body}", "mistral_nemo")
    assert answer.tool_calls[0].arguments == '{"x":1e2,"s":"}{\\"\\u00e9 ]","n":{"a":[1,{"b":2.50}]}}'
    for arguments, expected in (('"{\\"x\\": 1}"', '{"x":1}'), ("null", "{}")):
        answer, _ = parsed(f'[TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}]', "mistral_nemo")
        assert answer.tool_calls[0].arguments == expected
    answer, _ = parsed('[TOOL_CALLS][{"name": "f"}]', "mistral_nemo")
    assert answer.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "body",
    [
        f"[{WEATHER}, 3]",  # one element is no call: the block is content, no call is half taken
        '[{"name": "f", "arguments": {"x": }}]',
        '[{"name": 3, "arguments": {}}]',
        '[{"name": "f", "arguments": [1]}]',
        "[]",
        "hello there",
    ],
)
def test_a_json_form_that_is_no_call_stays_content(body: str) -> None:
    answer, recoveries = parsed(f"pre [TOOL_CALLS]{body}", "mistral_nemo")
    assert (answer.content, answer.tool_calls, recoveries) == (f"pre {body}", [], {"invalid_tool_call": 1})


def test_the_model_ending_inside_the_array() -> None:
    answer, recoveries = parsed(f"[TOOL_CALLS][{WEATHER}, {SEARCH},", "mistral_v3")
    assert (calls(answer), recoveries) == ([WEATHER_CALL, SEARCH_CALL], {"unclosed_call": 1})
    answer, recoveries = parsed(f'[TOOL_CALLS][{WEATHER}, {{"name": "f', "mistral_v3")
    assert (answer.content, recoveries) == (f'[{WEATHER}, {{"name": "f', {"invalid_tool_call": 1})


# ----------------------------------------------------------------------------- the v11 form


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]search[ARGS]'
        '{"q": "cats 你好 😀", "n": 1.0}',
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS] {"city": "Paris", "days": 3}\n'
        '[TOOL_CALLS] search [CALL_ID]x[ARGS]{"q": "cats 你好 😀", "n": 1.0}</s>',
        '[TOOL_CALLS]get_weather{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]search{"q": "cats 你好 😀", "n": 1.0}',
    ],
)
def test_the_v11_form(text: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, calls(answer), recoveries) == ("", [WEATHER_CALL, SEARCH_CALL], {})


def test_v11_arguments_nest_and_keep_their_spelling() -> None:
    answer, _ = parsed('[TOOL_CALLS]f[ARGS]{"a": {"b": [1, {"c": "}"}]}, "d": "\\"{", "e": 1e2}')
    assert answer.tool_calls[0].arguments == '{"a":{"b":[1,{"c":"}"}]},"d":"\\"{","e":1e2}'


def test_v11_text_before_between_and_after_the_calls() -> None:
    text = 'Checking.[TOOL_CALLS]f[ARGS]{"a": 1} so[TOOL_CALLS]g[ARGS]{}\n\n[TOOL_CALLS]h[ARGS]{}  Done.'
    answer, recoveries = parsed(text)
    assert [call.name for call in answer.tool_calls] == ["f", "g", "h"]
    assert (answer.content, recoveries) == ("Checking. so  Done.", {})


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('[TOOL_CALLS]f[ARGS]{"x": }', 'f{"x": }'),  # arguments that are not JSON
        ("[TOOL_CALLS]f[ARGS][1]", "f[1]"),  # not an object
        ("[TOOL_CALLS]f[ARGS] 42 then text", "f 42 then text"),
        ('[TOOL_CALLS][ARGS]{"x": 1}', '{"x": 1}'),  # no name
        ("[TOOL_CALLS]just text", "just text"),  # no arguments ever
        ('[TOOL_CALLS]f[ARGS]{"x": [ARGS]1}', 'f{"x": 1}'),  # a nested marker
        ('[TOOL_CALLS]f[ARGS]{"x": "[CALL_ID]"}', 'f{"x": ""}'),
        ('[TOOL_CALLS]f[ARGS]{"x": 1', 'f{"x": 1'),  # the model ended inside the arguments
    ],
)
def test_a_v11_call_that_is_no_call_stays_content(text: str, content: str) -> None:
    answer, recoveries = parsed(text)
    assert (answer.content, answer.tool_calls, recoveries) == (content, [], {"invalid_tool_call": 1})


def test_a_call_marker_inside_a_call_ends_it_and_opens_the_next() -> None:
    answer, recoveries = parsed('[TOOL_CALLS]f[ARGS]{"x": "[TOOL_CALLS]g[ARGS]{}')
    assert (answer.content, calls(answer), recoveries) == ('f{"x": "', [("g", {})], {"invalid_tool_call": 1})


def test_markers_typed_as_text_are_text() -> None:
    """Text that spells the control tokens is encoded as text: it never becomes a call or reasoning."""
    text = f'say [TOOL_CALLS]f[ARGS]{{"a": 1}} and [TOOL_CALLS][{WEATHER}] or [THINK]x[/THINK]'
    for model in (V11, "mistral_nemo", "mistral_v3"):
        answer, recoveries = all_ways(mistral(model), tokenizer(model).encode(text))
        assert (answer.content.strip(), answer.reasoning, answer.tool_calls, recoveries) == (text, "", [], {})


def test_stray_markers_are_dropped_and_counted() -> None:
    answer, recoveries = parsed("a[ARGS]b[CALL_ID]c")
    assert (answer.content, answer.tool_calls, recoveries) == ("abc", [], {"unknown_tag": 2})
    answer, recoveries = parsed("a [TOOL_CALLS] \n")  # a call marker and nothing after it
    assert (answer.content, answer.tool_calls, recoveries) == ("a  \n", [], {"invalid_tool_call": 1})


# ----------------------------------------------------------------------------- reasoning


def test_think_then_content_then_calls() -> None:
    answer, recoveries = parsed('[THINK]plan 😀\n[/THINK]Sure.[TOOL_CALLS]f[ARGS]{"a": 1}</s>')
    assert (answer.reasoning, answer.content, calls(answer), recoveries) == (
        "plan 😀\n",
        "Sure.",
        [("f", {"a": 1})],
        {},
    )


def test_reasoning_as_vllm_reads_it() -> None:
    """A [THINK] anywhere outside reasoning opens reasoning; the tool half goes on after it."""
    answer, recoveries = parsed("answer [THINK]more[/THINK] rest")
    assert (answer.reasoning, answer.content, recoveries) == ("more", "answer  rest", {})
    answer, recoveries = parsed('[TOOL_CALLS]f[ARGS]{"a": [THINK]hm[/THINK]1}')
    assert (answer.reasoning, calls(answer), recoveries) == ("hm", [("f", {"a": 1})], {})
    answer, recoveries = parsed("[THINK]a[THINK]b[/THINK]c[/THINK]d")
    assert (answer.reasoning, answer.content, recoveries) == ("ab", "cd", {"unknown_tag": 2})


def test_reasoning_going_straight_to_a_call_keeps_the_call() -> None:
    answer, recoveries = parsed('[THINK]hm[TOOL_CALLS]f[ARGS]{"a": 1}')
    assert (answer.reasoning, calls(answer), recoveries) == (
        "hm",
        [("f", {"a": 1})],
        {"missing_think_close": 1},
    )


def test_the_model_ending_inside_think() -> None:
    answer, recoveries = parsed("[THINK]still thinking")
    assert (answer.reasoning, answer.content, recoveries) == (
        "still thinking",
        "",
        {"missing_think_close": 1},
    )
    answer, recoveries = parsed("[THINK]still thinking", finish="length")
    assert (answer.reasoning, recoveries) == ("still thinking", {})


# ----------------------------------------------------------------------------- the rest


def test_with_tools_disabled_calls_are_dropped() -> None:
    answer, recoveries = parsed(
        f'a[TOOL_CALLS]f[ARGS]{{"x": 1}}b[TOOL_CALLS][{WEATHER}]', tools_enabled=False
    )
    assert (answer.content, answer.tool_calls, recoveries) == ("ab", [], {"tool_call_not_allowed": 2})


COMPLETION = (
    '[THINK]plan 你好[/THINK]Text [with] {braces}.[TOOL_CALLS]f[CALL_ID]x[ARGS]{"a": "}"}\n'
    "[TOOL_CALLS]g[ARGS]{} tail"
)


@pytest.mark.parametrize(
    ("model", "text"), [(V11, COMPLETION), ("mistral_nemo", f"Hi 😀 [TOOL_CALLS][{WEATHER}, {SEARCH}] tail")]
)
def test_a_max_tokens_cut_at_every_position(model: str, text: str) -> None:
    """No error, no half call, nothing counted; the answer is a prefix of the whole, and content
    streamed id by id is never taken back."""
    ids = ids_of(text, model)
    full = every_cut_is_a_prefix(mistral(model), ids)
    assert len(full.tool_calls) == 2 and full.content.strip().endswith("tail")


# ----------------------------------------------------------------------------- call ids


def test_call_ids_are_mistrals_and_render_back_through_the_family_template() -> None:
    """9 alphanumeric characters (vLLM gives Mistral calls such ids; the templates refuse others), so
    the answer sent back in the history renders, with its tool result."""
    for model, text in (
        (V11, '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}'),
        ("mistral_nemo", f"[TOOL_CALLS][{WEATHER}, {SEARCH}]"),
    ):
        answer = parse_answer(mistral(model, ids=False)(), ids_of(text, model), "stop")
        ids = [call.id for call in answer.tool_calls]
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id in ids) and len(set(ids)) == 2
        assert call_ids_for(card(model), tokenizer(model))() != ids[0]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "weather?"}, assistant_message(answer)]
        messages += [{"role": "tool", "tool_call_id": call_id, "content": "sunny"} for call_id in ids]
        request = ChatCompletionRequest(model=model, messages=messages)
        rendered = JinjaFormatter.from_model_dir(directory(model)).render(request).text
        assert all(call_id in rendered for call_id in ids)
