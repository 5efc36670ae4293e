"""The mock engine's answers for the ``--tool-call-parser`` it serves under: DeepSeek V3 / V3.1 calls
on a DeepSeek prompt (tools read from its system text, reasoning when the prompt opened a think
block), Qwen3-Coder XML calls on a Qwen3 prompt. Real prompts from the real preprocessor; each
answer is read back by the parsers of the same names, which find the call the mock meant."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from support.hf_models import built_models
from support.parsers import all_ways, counting_ids

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.mock.answer import BODIES
from dynamo_prep.engines.mock.engine import MockEngine
from dynamo_prep.formatter import prompt_formatter_for
from dynamo_prep.parsing import ParsedAnswer, answer_parser_for, thinking_requested, tool_properties
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "spots": {"type": "array"},
                "ratio": {"type": ["number", "null"]},
            },
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ARGUMENTS = {"city": "mock", "days": 1, "hourly": True, "spots": [], "ratio": 1}
CALLED = [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
]
# (model directory, --tool-call-parser, --reasoning-parser)
SERVED = [
    ("deepseek_v3", "deepseek_v31", "deepseek_v3"),
    ("deepseek_v3", "deepseek_v3", "deepseek_v3"),
    ("qwen3", "qwen3_coder", "qwen3"),
]


@cache
def directory(model: str) -> Path:
    return built_models()[model]


@cache
def engine(model: str, parser: str) -> MockEngine:
    return MockEngine(directory(model), flavor="vllm", reply_format="model", tool_call_parser=parser)


def card(model: str, parser: str, reasoning: str) -> ModelDeploymentCard:
    runtime = ModelRuntimeConfig(tool_call_parser=parser, reasoning_parser=reasoning)
    return ModelDeploymentCard.from_model_dir(directory(model), runtime_config=runtime)


def request(model: str, messages: list[dict[str, Any]], **fields: Any) -> PreprocessedRequest:
    served = ModelDeploymentCard.from_model_dir(directory(model))
    formatter = prompt_formatter_for(served, str(directory(model)))
    preprocessor = OpenAIPreprocessor.new_with_parts(
        served, formatter, Tokenizer.from_model_dir(directory(model))
    )
    return preprocessor.preprocess({"model": model, "messages": messages, **fields})


def answer(served: tuple[str, str, str], messages: list[dict[str, Any]], **fields: Any) -> ParsedAnswer:
    """The mock's answer to ``messages``, read by the parsers the worker declares."""
    model, parser, reasoning = served
    mock = engine(model, parser)
    prompt = request(model, messages, **fields)
    kwargs = fields.get("chat_template_kwargs", {})

    def make():  # type: ignore[no-untyped-def]
        return answer_parser_for(
            card(model, parser, reasoning),
            mock.tokenizer,
            thinking=mock.tokenizer.decode(prompt.token_ids).rstrip().endswith("<think>"),
            thinking_requested=thinking_requested(kwargs),
            tool_properties=tool_properties(fields.get("tools")),
            call_ids=counting_ids(),
        )

    parsed, recoveries = all_ways(make, mock.reply_ids(prompt))
    assert recoveries == {}
    return parsed


def calls(parsed: ParsedAnswer) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_every_written_format_is_a_registered_parser() -> None:
    from dynamo_prep.parsing import TOOL_CALL_PARSERS  # noqa: PLC0415

    assert set(BODIES) <= set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("served", SERVED, ids=[parser for _, parser, _ in SERVED])
def test_the_user_speaking_last_gets_a_call_of_the_first_tool(served: tuple[str, str, str]) -> None:
    parsed = answer(served, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, CLOCK])
    assert calls(parsed) == [("get_weather", ARGUMENTS)]
    content = parsed.content.rstrip("\n")  # ChatML writes a newline between the content and the call
    assert content.startswith("[mock vllm]") and content.endswith("You said: Weather in Paris?")
    assert parsed.reasoning == ""


@pytest.mark.parametrize("served", SERVED, ids=[parser for _, parser, _ in SERVED])
def test_after_a_tool_result_the_answer_says_what_it_returned(served: tuple[str, str, str]) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": CALLED},
        {"role": "tool", "tool_call_id": "c1", "content": "18C & sunny"},
    ]
    parsed = answer(served, messages, tools=[WEATHER])
    assert (parsed.content, parsed.tool_calls) == ("[mock vllm] the tool returned: 18C & sunny", [])


def test_deepseek_thinking_writes_the_reasoning_before_the_call() -> None:
    served = SERVED[0]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    parsed = answer(served, messages, tools=[WEATHER], chat_template_kwargs={"thinking": True})
    assert (parsed.reasoning, calls(parsed)) == ("I will call get_weather.", [("get_weather", ARGUMENTS)])
    parsed = answer(served, messages, chat_template_kwargs={"thinking": True})  # no tools: no call
    assert (parsed.reasoning, parsed.tool_calls) == ("I will echo the last user message.", [])


def test_deepseek_tool_choice_none_and_no_tools_write_no_call() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert answer(SERVED[0], messages).tool_calls == []
    assert answer(SERVED[0], messages, tools=[WEATHER], tool_choice="none").tool_calls == []
