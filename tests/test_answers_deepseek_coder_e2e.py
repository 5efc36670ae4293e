"""DeepSeek V3 / V3.1 and Qwen3-Coder answers end to end, with the official ``openai`` client against
a real frontend and mock workers serving real vocabularies under vLLM's flags: the mock writes its
calls as the declared ``--tool-call-parser`` reads them, the frontend parses them back (streamed and
not, the same answer), forced tool choices go through the engine grammar path, the Responses API
returns ``function_call`` items, and malformed output is content, counted by family."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.hf_models import built_models
from test_answers_e2e import assert_same, both, calls_of, user
from test_answers_families_e2e import parse_errors

V31, V3, CODER = "deepseek-v31", "deepseek-v3", "qwen3-coder"
MODELS = (V31, V3, CODER)
FAMILIES = {V31: "deepseek_v3+deepseek_v31", V3: "deepseek_v3", CODER: "qwen3+qwen3_coder"}
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
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "minLength": 3}}},
    },
}
MOCK_ARGUMENTS = {"city": "mock", "days": 1, "hourly": True, "spots": []}  # the mock's, by the schema
ASKED = "What is the weather in Paris?"
BAD_ARGUMENTS = '{"city": }'
REPLIES = [
    # a V3.1 call whose arguments are no JSON: the block stays content, counted
    {
        "when": "broken-call",
        "segments": [
            ["Checking.", False],
            ["<｜tool▁calls▁begin｜>", True],
            ["<｜tool▁call▁begin｜>", True],
            ["get_weather", False],
            ["<｜tool▁sep｜>", True],
            [BAD_ARGUMENTS, False],
            ["<｜tool▁call▁end｜>", True],
            ["<｜tool▁calls▁end｜>", True],
        ],
    },
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("deepseek-coder")
    replies = directory / "replies.jsonl"
    replies.write_text("".join(json.dumps(line) + "\n" for line in REPLIES), encoding="utf-8")
    deepseek, qwen3 = str(built_models()["deepseek_v3"]), str(built_models()["qwen3"])
    v31 = (
        "--tool-call-parser",
        "deepseek_v31",
        "--reasoning-parser",
        "deepseek_v3",
        "--replies",
        str(replies),
    )
    workers = [
        ("--model-path", deepseek, "--served-name", V31, *v31),
        ("--model-path", deepseek, "--served-name", V3, "--tool-call-parser", "deepseek_v3"),
        (
            "--model-path",
            qwen3,
            "--served-name",
            CODER,
            "--tool-call-parser",
            "qwen3_coder",
            "--reasoning-parser",
            "qwen3",
        ),
    ]
    with mock_cluster(directory, workers) as running:
        yield running


@pytest.mark.parametrize("model", MODELS)
def test_calls_streamed_and_not(cluster: Cluster, model: str) -> None:
    whole, folded = both(cluster, model=model, messages=user(ASKED), tools=[WEATHER, TIME])
    assert_same(whole, folded)
    choice = whole.choices[0]
    assert calls_of(choice.message) == [("get_weather", MOCK_ARGUMENTS)]  # qwen3_coder: typed by the schema
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].id.startswith("call_")
    content = choice.message.content or ""
    assert content.startswith("[mock sglang]") and content.rstrip().endswith(f"You said: {ASKED}")
    assert not any(marker in content for marker in ("<｜", "<tool_call>", "<function=", "<parameter="))


@pytest.mark.parametrize("model", MODELS)
def test_the_tool_result_goes_back_and_the_answer_says_what_it_returned(cluster: Cluster, model: str) -> None:
    whole = client(cluster).chat.completions.create(model=model, messages=user(ASKED), tools=[WEATHER])
    message = whole.choices[0].message
    follow_up = [
        *user(ASKED),
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18C & sunny"},
    ]
    whole, folded = both(cluster, model=model, messages=follow_up, tools=[WEATHER])
    assert_same(whole, folded)
    assert whole.choices[0].message.content == "[mock sglang] the tool returned: 18C & sunny"
    assert whole.choices[0].finish_reason == "stop"


def test_deepseek_thinking_by_the_template_kwargs(cluster: Cluster) -> None:
    thinking = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    whole, folded = both(cluster, model=V31, messages=user(ASKED), tools=[WEATHER], **thinking)
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.reasoning_content == "I will call get_weather."
    assert calls_of(message) == [("get_weather", MOCK_ARGUMENTS)]
    whole, _ = both(cluster, model=V31, messages=user(ASKED), tools=[WEATHER])  # thinking off
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(cluster: Cluster, model: str, stream: bool) -> None:
    """The engine grammar path: the mock answers an instance of the forced schema (``zone`` needs 3
    characters, which an unconstrained call would not have)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        asked: dict[str, Any] = {"model": model, "messages": user(ASKED), "tools": [WEATHER, TIME]}
        whole, folded = both(cluster, **asked, tool_choice=choice)
        assert_same(whole, folded)
        calls = calls_of(whole.choices[0].message)
        assert calls and whole.choices[0].finish_reason == "tool_calls"
        if choice != "required":
            assert [name for name, _ in calls] == ["get_time"]
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])  # type: ignore[arg-type]


@pytest.mark.parametrize("model", MODELS)
def test_the_responses_api_returns_function_call_items(cluster: Cluster, model: str) -> None:
    response = client(cluster).responses.create(
        model=model, input=ASKED, tools=[{"type": "function", **WEATHER["function"]}]
    )
    items = [item for item in response.output if item.type == "function_call"]
    assert [(item.name, json.loads(item.arguments)) for item in items] == [("get_weather", MOCK_ARGUMENTS)]
    assert items[0].call_id.startswith("call_")


def test_a_broken_call_is_content_counted_by_family(cluster: Cluster) -> None:
    key = (FAMILIES[V31], "invalid_tool_call")
    before = parse_errors(cluster, V31).get(key, 0.0)
    whole, folded = both(cluster, model=V31, messages=user("broken-call"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert not message.tool_calls and whole.choices[0].finish_reason == "stop"
    assert message.content.startswith("Checking.<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>")
    assert parse_errors(cluster, V31)[key] == before + 2  # both requests
