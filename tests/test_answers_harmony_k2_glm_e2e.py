"""GPT-OSS Harmony (chosen by model_type, no flag), Kimi-K2 (``--tool-call-parser kimi_k2``) and
GLM-4.5 (``--tool-call-parser glm45 --reasoning-parser glm45``) end to end with the official
``openai`` client against a real frontend and mock workers: reasoning, content and calls streamed
and not, malformed calls as content counted by family, a forced ``tool_choice`` (the mock answers
the engine grammar's JSON in the family's format), and the Responses API's ``function_call`` items."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.hf_models import built_models
from test_answers_e2e import WEATHER, assert_same, both, calls_of, user
from test_answers_families_e2e import parse_errors

GPT_OSS, KIMI_K2, GLM = "gpt-oss-mock", "kimi-k2-mock", "glm45-mock"
MARKUP = ("<|channel|>", "<|message|>", "<|start|>", "<|tool_call", "<arg_key>", "<tool_call>", "<think>")

REPLIES = {
    "oss-call": (
        "<|channel|>analysis<|message|>The user wants Lima's weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Lima", "days": 2}<|call|>'
    ),
    "oss-answer": (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
    ),
    "oss-bad": "<|channel|>commentary to=functions.get_weather json<|message|>{not json}<|call|>",
    "k2-call": (
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Lima", "days": 2}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    ),
    "k2-bad": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>{oops<|tool_call_end|><|tool_calls_section_end|>"
    ),
    "glm-call": (
        "\n<think>The user wants Lima.</think>\nChecking.\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Lima</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>2</arg_value>\n</tool_call><|observation|>"
    ),
    "glm-bad": "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Lima</arg_value>\n</tool_call>",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("families2")
    models = built_models()
    replies = directory / "replies.jsonl"
    replies.write_text("".join(json.dumps({"when": k, "text": v}) + "\n" for k, v in REPLIES.items()))
    common = ("--replies", str(replies))
    workers = [
        ("--model-path", str(models["gpt_oss"]), "--served-name", GPT_OSS, *common),
        (
            "--model-path",
            str(models["kimi_k2"]),
            "--served-name",
            KIMI_K2,
            "--tool-call-parser",
            "kimi_k2",
            *common,
        ),
        (
            *("--model-path", str(models["glm45"]), "--served-name", GLM, *common),
            *("--tool-call-parser", "glm45", "--reasoning-parser", "glm45"),
        ),
    ]
    with mock_cluster(directory, workers) as running:
        yield running


def no_markup(*texts: str | None) -> bool:
    return not any(marker in (text or "") for text in texts for marker in MARKUP)


def test_harmony_reasoning_preamble_and_a_call_streamed_and_not(cluster: str) -> None:
    whole, folded = both(cluster, model=GPT_OSS, messages=user("oss-call"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.reasoning_content == "The user wants Lima's weather."
    assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
    assert calls_of(message) == [("get_weather", {"city": "Lima", "days": 2})]
    assert message.tool_calls[0].id.startswith("call_")
    whole, folded = both(cluster, model=GPT_OSS, messages=user("oss-answer"))
    assert_same(whole, folded)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == ("Sunny.", "stop")


def test_kimi_k2_calls_carry_the_models_ids(cluster: str) -> None:
    whole, folded = both(cluster, model=KIMI_K2, messages=user("k2-call"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.content == "Let me check." and whole.choices[0].finish_reason == "tool_calls"
    assert calls_of(message) == [
        ("get_weather", {"city": "Lima", "days": 2}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert [call.id for call in message.tool_calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    assert [folded["calls"][i]["id"] for i in (0, 1)] == [
        "functions.get_weather:0",
        "functions.get_weather:1",
    ]


def test_glm45_values_are_typed_by_the_requests_schema(cluster: str) -> None:
    whole, folded = both(cluster, model=GLM, messages=user("glm-call"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.reasoning_content == "The user wants Lima."
    assert (message.content or "").strip() == "Checking."
    assert calls_of(message) == [("get_weather", {"city": "Lima", "days": 2})]  # days: integer


@pytest.mark.parametrize(
    ("model", "when", "family"),
    [(GPT_OSS, "oss-bad", "openai_gptoss+openai"), (KIMI_K2, "k2-bad", "kimi_k2"), (GLM, "glm-bad", "glm45")],
)
def test_a_malformed_call_is_content_without_markup_and_counted(
    cluster: str, model: str, when: str, family: str
) -> None:
    before = parse_errors(cluster, model).get((family, "invalid_tool_call"), 0.0)
    whole, folded = both(cluster, model=model, messages=user(when), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert not message.tool_calls and whole.choices[0].finish_reason == "stop"
    assert "Lima" in message.content or "not json" in message.content or "oops" in message.content
    assert model == GLM or no_markup(message.content)  # GLM's invalid block stays as written, tags too
    assert parse_errors(cluster, model)[(family, "invalid_tool_call")] == before + 2  # both requests


@pytest.mark.parametrize("model", [GPT_OSS, KIMI_K2, GLM])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_choice_calls_the_tool(cluster: str, model: str, choice: str) -> None:
    """The engine's grammar holds the answer to the call's JSON (the mock writes an instance of the
    schema as the family's content); the frontend returns it as the call, streamed and not."""
    forced: Any = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    whole, folded = both(
        cluster, model=model, messages=user("Weather in Paris?"), tools=[WEATHER], tool_choice=forced
    )
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert [name for name, _ in calls_of(message)] == ["get_weather"]
    assert whole.choices[0].finish_reason == "tool_calls" and not message.content


@pytest.mark.parametrize(("model", "when"), [(GPT_OSS, "oss-call"), (KIMI_K2, "k2-call"), (GLM, "glm-call")])
def test_the_responses_api_returns_function_call_items(cluster: str, model: str, when: str) -> None:
    response = client(cluster).responses.create(
        model=model, input=when, tools=[{"type": "function", **WEATHER["function"]}]
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("get_weather", {"city": "Lima", "days": 2})
    assert all(no_markup(item.model_dump_json()) for item in response.output)
    if model == KIMI_K2:
        assert [call.call_id for call in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
