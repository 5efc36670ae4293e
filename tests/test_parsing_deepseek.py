"""DeepSeek tool calls (``deepseek_v3``: ``function<｜tool▁sep｜>NAME`` and fenced JSON; ``deepseek_v31``:
``NAME<｜tool▁sep｜>{...}``) and the ``deepseek_v3`` reasoning parser (thinking on: DeepSeek-R1's; off:
no reasoning), on a DeepSeek vocabulary whose five tool markers and think tags are added tokens:
calls released whole, markers matched on their ids, whatever is no call kept as content, counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids
from test_parsing_streams import QWEN
from test_parsing_streams import tokenizer as demo_tokenizer

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.parsing import (
    AnswerParser,
    ParsedAnswer,
    ParseOptions,
    ToolCallDelta,
    answer_parser_for,
    parser_for,
    thinking_requested,
)
from dynamo_prep.parsing._tokens import vocab_of
from dynamo_prep.parsing.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP
from dynamo_prep.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP, THINK_OPEN, THINK_CLOSE)


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(built_models()["deepseek_v3"])


def v31_call(name: str, arguments: str) -> tuple[str, ...]:
    return (CALL_BEGIN, name, TOOL_SEP, arguments, CALL_END)


def v3_call(name: str, arguments: str) -> tuple[str, ...]:
    return (CALL_BEGIN, "function", TOOL_SEP, f"{name}\n```json\n{arguments}\n```", CALL_END)


def ids_of(*parts: str | tuple[str, ...], tok: Tokenizer | None = None) -> list[int]:
    """The parts as the model writes them: each marker string one id, the rest text."""
    tok = tok or tokenizer()
    flat = [piece for part in parts for piece in ((part,) if isinstance(part, str) else part)]
    return tok.encode_segments([(piece, piece in MARKERS) for piece in flat if piece])


def make(
    tools: str | None = "deepseek_v31",
    reasoning: str | None = None,
    tok: Tokenizer | None = None,
    **options: object,
) -> Callable[[], AnswerParser]:
    vocab = vocab_of(tok or tokenizer())
    return lambda: parser_for(vocab, reasoning, tools, ParseOptions(call_ids=counting_ids(), **options))  # type: ignore[arg-type]


def parsed(
    *parts: str | tuple[str, ...], finish: str = "stop", maker: Callable[[], AnswerParser] | None = None
) -> tuple[ParsedAnswer, dict[str, int]]:
    return all_ways(maker or make(), ids_of(*parts), finish)


def calls(answer: ParsedAnswer) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in answer.tool_calls]


WEATHER = '{"city": "Paris", "days": 3}'
SEARCH = '{"q": "cats 你好 😀", "n": 1.0}'
WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
SEARCH_CALL = ("search", {"q": "cats 你好 😀", "n": 1.0})


def test_the_markers_are_tokens_and_the_registry_builds_both_forms() -> None:
    assert all(marker in tokenizer().added_tokens for marker in MARKERS)
    assert make("deepseek_v3")().family == "deepseek_v3"
    assert make("deepseek_v31", "deepseek_v3")().family == "deepseek_v3+deepseek_v31"


@pytest.mark.parametrize(("tools", "call"), [("deepseek_v31", v31_call), ("deepseek_v3", v3_call)])
def test_calls_in_either_form(tools: str, call: Callable[[str, str], tuple[str, ...]]) -> None:
    answer, recoveries = parsed(
        "Let me look. ",
        CALLS_BEGIN,
        call("get_weather", WEATHER),
        "\n",
        call("search", SEARCH),
        CALLS_END,
        maker=make(tools),
    )
    assert (answer.content, calls(answer), recoveries) == ("Let me look. ", [WEATHER_CALL, SEARCH_CALL], {})
    assert answer.tool_calls[0] == ToolCallDelta(0, "call_0", "get_weather", '{"city":"Paris","days":3}')
    assert answer.tool_calls[1].index == 1


def test_arguments_keep_the_models_spelling_compacted_and_nest() -> None:
    body = '{"x": 1e2, "s": "}{\\"\\u00e9 ]", "n": {"a": [1, {"b": 2.50}]}}'
    answer, _ = parsed(CALLS_BEGIN, v31_call("f", body), CALLS_END)
    assert answer.tool_calls[0].arguments == '{"x":1e2,"s":"}{\\"\\u00e9 ]","n":{"a":[1,{"b":2.50}]}}'
    pretty = json.dumps({"city": "Paris", "n": [1, 2]}, indent=2)  # vLLM's '.' regexes lose this call
    answer, recoveries = parsed(CALLS_BEGIN, v3_call("f", pretty), CALLS_END, maker=make("deepseek_v3"))
    assert (calls(answer), recoveries) == ([("f", {"city": "Paris", "n": [1, 2]})], {})


@pytest.mark.parametrize("fence", ["```json\n{}\n```", "```\n{}\n```", "{}", "```json{}```"])
def test_v3_reads_the_json_fenced_or_not(fence: str) -> None:
    parts = (CALLS_BEGIN, CALL_BEGIN, "function", TOOL_SEP, f"f\n{fence}", CALL_END, CALLS_END)
    answer, recoveries = parsed(*parts, maker=make("deepseek_v3"))
    assert (answer.content, calls(answer), recoveries) == ("", [("f", {})], {})


def test_text_after_the_calls_is_content_and_whitespace_between_them_is_not() -> None:
    answer, recoveries = parsed(
        CALLS_BEGIN, v31_call("f", "{}"), " \n ", v31_call("g", "{}"), "\n", CALLS_END, "\n Done.", "\n"
    )
    assert (answer.content, [c.name for c in answer.tool_calls], recoveries) == ("\n Done.\n", ["f", "g"], {})
    answer, _ = parsed(CALLS_BEGIN, v31_call("f", "{}"), " oops ", v31_call("g", "{}"), CALLS_END)
    assert (answer.content, len(answer.tool_calls)) == (" oops ", 2)  # text between calls: content


@pytest.mark.parametrize(
    "bad",
    [
        v31_call("f", '{"x": }'),  # arguments that are not JSON
        v31_call("f", "[1, 2]"),  # JSON that is no object
        v31_call("", "{}"),  # no name
        (CALL_BEGIN, "f", CALL_END),  # no separator
    ],
)
def test_a_block_that_is_no_call_is_content_with_its_markers_the_others_calls(bad: tuple[str, ...]) -> None:
    answer, recoveries = parsed("Hi ", CALLS_BEGIN, v31_call("get_weather", WEATHER), bad, CALLS_END)
    assert calls(answer) == [WEATHER_CALL]
    assert answer.content == "Hi " + "".join(bad)
    assert recoveries == {"invalid_tool_call": 1}


def test_a_call_without_the_calls_section_is_still_a_call() -> None:
    answer, recoveries = parsed("Sure.", v31_call("get_weather", WEATHER))
    assert (answer.content, calls(answer), recoveries) == ("Sure.", [WEATHER_CALL], {"missing_tools_open": 1})


def test_the_model_ending_inside_a_call() -> None:
    answer, recoveries = parsed(CALLS_BEGIN, CALL_BEGIN, "get_weather", TOOL_SEP, WEATHER)
    assert (calls(answer), recoveries) == ([WEATHER_CALL], {"unclosed_call": 1})
    answer, recoveries = parsed(CALLS_BEGIN, v31_call("f", "{}"), CALL_BEGIN, "g", TOOL_SEP, '{"a": ')
    assert (answer.content, [c.name for c in answer.tool_calls]) == (f'{CALL_BEGIN}g{TOOL_SEP}{{"a": ', ["f"])
    assert recoveries == {"invalid_tool_call": 1}
    # a call opened before the last one closed: the first is recovered, the second read as usual
    answer, recoveries = parsed(CALLS_BEGIN, CALL_BEGIN, "f", TOOL_SEP, "{}", v31_call("g", "{}"), CALLS_END)
    assert ([c.name for c in answer.tool_calls], recoveries) == (["f", "g"], {"unclosed_call": 1})


def test_a_max_tokens_cut_never_half_sends_a_call_and_counts_nothing() -> None:
    ids = ids_of("Hi", CALLS_BEGIN, v31_call("get_weather", WEATHER), v31_call("search", SEARCH), CALLS_END)
    full, _ = all_ways(make(), ids)
    for cut in range(len(ids) + 1):
        answer, recoveries = all_ways(make(), ids[:cut], "length")
        assert recoveries == {}
        assert answer.tool_calls == full.tool_calls[: len(answer.tool_calls)]
        assert answer.content == "Hi"[: len(answer.content)]


def test_markers_out_of_place_are_dropped_and_counted_never_content() -> None:
    answer, recoveries = parsed("a", CALLS_END, "b", TOOL_SEP, "c", CALL_END, "d")
    assert (answer.content, answer.tool_calls, recoveries) == ("abcd", [], {"unknown_tag": 3})
    answer, recoveries = parsed(CALLS_BEGIN, CALLS_BEGIN, v31_call("f", "{}"), CALLS_END)
    assert (answer.content, len(answer.tool_calls), recoveries) == ("", 1, {"unknown_tag": 1})


def test_markers_spelled_as_text_are_text() -> None:
    """The model writing a marker's characters (not its token) writes text."""
    spelled = [i for piece in (CALLS_BEGIN[:5], CALLS_BEGIN[5:]) for i in tokenizer().encode(piece)]
    ids = tokenizer().encode("See ") + spelled + tokenizer().encode("there")
    answer, recoveries = all_ways(make(), ids)
    assert (answer.content, answer.tool_calls, recoveries) == (f"See {CALLS_BEGIN}there", [], {})


def test_on_a_vocabulary_without_the_markers_they_are_read_in_text() -> None:
    tok = demo_tokenizer(QWEN)
    text = f"Hi{CALLS_BEGIN}{CALL_BEGIN}get_weather{TOOL_SEP}{WEATHER}{CALL_END}{CALLS_END} bye"
    answer, recoveries = all_ways(make(tok=tok), tok.encode(text))
    assert (answer.content, calls(answer), recoveries) == ("Hi bye", [WEATHER_CALL], {})
    answer, _ = all_ways(make(tok=tok), tok.encode("a <｜tool▁call"), "length")  # a partial marker at a cut
    assert answer.content == "a "


def test_tool_choice_none_drops_the_calls_and_no_markup_leaks() -> None:
    answer, recoveries = parsed(
        "Hi", CALLS_BEGIN, v31_call("get_weather", WEATHER), CALLS_END, maker=make(tools_enabled=False)
    )
    assert (answer.content, answer.tool_calls, recoveries) == ("Hi", [], {"tool_call_not_allowed": 1})


# -- deepseek_v3 reasoning ---------------------------------------------------------------------------


def reasoning(thinking_requested: bool, thinking: bool = False) -> Callable[[], AnswerParser]:
    return make("deepseek_v31", "deepseek_v3", thinking_requested=thinking_requested, thinking=thinking)


@pytest.mark.parametrize(("requested", "opened"), [(True, False), (False, True), (True, True)])
def test_thinking_on_reads_reasoning_up_to_the_close_as_r1_does(requested: bool, opened: bool) -> None:
    answer, recoveries = parsed(
        "Paris, 3 days.",
        THINK_CLOSE,
        "\n\nLet me look.",
        CALLS_BEGIN,
        v31_call("get_weather", WEATHER),
        CALLS_END,
        maker=reasoning(requested, opened),
    )
    assert (answer.reasoning, answer.content, calls(answer), recoveries) == (
        "Paris, 3 days.",
        "\n\nLet me look.",
        [WEATHER_CALL],
        {},
    )
    answer, recoveries = parsed(THINK_OPEN, "hm", THINK_CLOSE, "ok", maker=reasoning(requested, opened))
    assert (answer.reasoning, answer.content, recoveries) == ("hm", "ok", {})
    answer, recoveries = parsed("still thinking", maker=reasoning(requested, opened))
    assert (answer.reasoning, answer.content, recoveries) == (
        "still thinking",
        "",
        {"missing_think_close": 1},
    )


def test_calls_inside_reasoning_end_it() -> None:
    answer, recoveries = parsed("hm", CALLS_BEGIN, v31_call("f", "{}"), CALLS_END, maker=reasoning(True))
    assert (answer.reasoning, [c.name for c in answer.tool_calls], recoveries) == (
        "hm",
        ["f"],
        {"missing_think_close": 1},
    )


def test_thinking_off_is_all_content_and_think_tags_are_dropped() -> None:
    answer, recoveries = parsed("Paris.", CALLS_BEGIN, v31_call("f", "{}"), CALLS_END, maker=reasoning(False))
    assert (answer.reasoning, answer.content, len(answer.tool_calls), recoveries) == ("", "Paris.", 1, {})
    answer, recoveries = parsed(THINK_OPEN, "hm", THINK_CLOSE, "ok", maker=reasoning(False))
    assert (answer.reasoning, answer.content, recoveries) == ("", "hmok", {"unknown_tag": 2})


def test_thinking_is_requested_by_the_template_kwargs_as_vllm_reads_them() -> None:
    assert thinking_requested({"thinking": True}) and thinking_requested({"enable_thinking": 1})
    assert not thinking_requested({}) and not thinking_requested({"thinking": False, "other": True})


def test_a_card_declaring_the_parsers_gets_them() -> None:
    runtime = ModelRuntimeConfig(tool_call_parser="deepseek_v31", reasoning_parser="deepseek_v3")
    card = ModelDeploymentCard.from_model_dir(built_models()["deepseek_v3"], runtime_config=runtime)

    def made(requested: bool) -> Callable[[], AnswerParser]:
        return lambda: answer_parser_for(card, tokenizer(), thinking=False, thinking_requested=requested)

    assert made(True)().family == "deepseek_v3+deepseek_v31"
    answer, _ = all_ways(made(True), ids_of("hm", THINK_CLOSE, "ok"))
    assert (answer.reasoning, answer.content) == ("hm", "ok")
    answer, _ = all_ways(made(False), ids_of("hm", THINK_CLOSE, "ok"))
    assert (answer.reasoning, answer.content) == ("", "hmok")


# -- anything at all -------------------------------------------------------------------------------

PIECES = (
    *MARKERS,
    "get_weather",
    "function",
    "\n```json\n",
    "\n```",
    WEATHER,
    '{"a": ',
    "}",
    " ",
    "\n",
    "你好 😀",
    "<｜tool",
)


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=40),
    tools=st.sampled_from(["deepseek_v3", "deepseek_v31"]),
    requested=st.booleans(),
    finish=st.sampled_from(["stop", "length"]),
)
def test_any_sequence_of_markers_and_text_gives_only_documented_behaviour(
    pieces: list[str], tools: str, requested: bool, finish: str
) -> None:
    answer, recoveries = parsed(*pieces, finish=finish, maker=reasoning_of(tools, requested))
    for tool_call in answer.tool_calls:
        assert tool_call.name and isinstance(json.loads(tool_call.arguments), dict)
    if not recoveries.get("invalid_tool_call"):  # only a block that is no call spells its markers
        assert not any(marker in answer.content for marker in MARKERS[:5])
    assert not any(tag in answer.content + answer.reasoning for tag in (THINK_OPEN, THINK_CLOSE))


def reasoning_of(tools: str, requested: bool) -> Callable[[], AnswerParser]:
    return make(tools, "deepseek_v3", thinking_requested=requested)


def test_a_hostile_100k_id_answer_keeps_every_character() -> None:
    """50,000 calls that never get their separator, then text: each is content, counted, in one pass."""
    ids = ids_of(*[(CALL_BEGIN, "x")] * 50_000, "end")
    answer, recoveries = all_ways(make(), ids, seeds=(0,))
    assert answer.content == f"{CALL_BEGIN}x" * 50_000 + "end"
    assert recoveries == {"invalid_tool_call": 50_000, "missing_tools_open": 1}
