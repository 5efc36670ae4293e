"""Mistral end to end with the official ``openai`` client: a real frontend and mock workers on Mistral
directories (tests/support/hf_models) declaring ``--tool-call-parser mistral`` (and, for Mistral Small
3.2, ``--reasoning-parser mistral``); the mock answers in Mistral's own format. Calls come back with
Mistral's ids, the same streamed and not, render when sent back; a forced tool choice and the Responses
API give the same calls; malformed output is content, counted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.hf_models import built_models
from test_answers_e2e import WEATHER, assert_same, both, calls_of, user
from test_answers_families_e2e import parse_errors

SMALL3, NEMO = "mistral-small-3", "mistral-nemo"
ARGUMENTS = {"city": "mock", "days": 1}  # what the mock builds from WEATHER's schema
REASONING = "I will call get_weather."
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
REPLIES = {
    "mistral-bad": [["[TOOL_CALLS]", True], ["get_weather", False], ["[ARGS]", True], ['{"city": }', False]],
    "mistral-typed": [["say [TOOL_CALLS]get_weather[ARGS]{} as text", False]],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("mistral")
    replies = directory / "replies.jsonl"
    lines = [{"when": when, "segments": segments} for when, segments in REPLIES.items()]
    replies.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    models = built_models()
    parsers = ("--tool-call-parser", "mistral", "--flavor", "vllm")
    workers = [
        ("--model-path", str(models["mistral_small_3"]), "--served-name", SMALL3, *parsers,
         "--reasoning-parser", "mistral", "--replies", str(replies)),
        ("--model-path", str(models["mistral_nemo"]), "--served-name", NEMO, *parsers),
    ]  # fmt: skip
    with mock_cluster(directory, workers, ready_timeout_s=180) as running:  # tekken: 131k-token vocabularies
        yield running


@pytest.mark.parametrize("model", [SMALL3, NEMO])
def test_the_mock_answers_with_mistral_calls_streamed_and_not(cluster: str, model: str) -> None:
    whole, folded = both(cluster, model=model, messages=user("Weather in Paris?"), tools=[WEATHER])
    assert_same(whole, folded)
    message, choice = whole.choices[0].message, whole.choices[0]
    assert calls_of(message) == [("get_weather", ARGUMENTS)] and choice.finish_reason == "tool_calls"
    assert MISTRAL_ID.fullmatch(message.tool_calls[0].id)
    assert (getattr(message, "reasoning_content", None) or "") == (REASONING if model == SMALL3 else "")
    assert message.content.startswith("[mock vllm]") and "Weather in Paris?" in message.content
    assert not any(marker in message.content for marker in ("[TOOL_CALLS]", "[ARGS]", "[THINK]"))


@pytest.mark.parametrize("model", [SMALL3, NEMO])
def test_the_call_sent_back_renders_and_the_result_is_read(cluster: str, model: str) -> None:
    """The family's template refuses ids that are not 9 alphanumeric characters: ours render."""
    api = client(cluster)
    first = api.chat.completions.create(model=model, messages=user("Weather in Paris?"), tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    messages: list[dict[str, Any]] = [
        *user("Weather in Paris?"),
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    follow = api.chat.completions.create(model=model, messages=messages, tools=[WEATHER])
    assert follow.choices[0].message.content == "[mock vllm] the tool returned: sunny, 21 C"
    assert follow.choices[0].finish_reason == "stop" and not follow.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_choice_gives_the_call(cluster: str, tool_choice: Any) -> None:
    """The engine is constrained to the call's JSON (the mock builds an instance); the Mistral reasoning
    stays free and the JSON becomes the call, with Mistral's id."""
    whole, folded = both(
        cluster, model=SMALL3, messages=user("Say hello"), tools=[WEATHER], tool_choice=tool_choice
    )
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert [name for name, _ in calls_of(message)] == ["get_weather"]
    assert MISTRAL_ID.fullmatch(message.tool_calls[0].id) and not message.content
    assert message.reasoning_content == "I will answer in JSON."


@pytest.mark.parametrize("model", [SMALL3, NEMO])
def test_the_responses_api_returns_function_call_items(cluster: str, model: str) -> None:
    response = client(cluster).responses.create(
        model=model, input="Weather in Paris?", tools=[{"type": "function", **WEATHER["function"]}]
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGUMENTS)]
    assert MISTRAL_ID.fullmatch(calls[0].call_id)


def test_malformed_output_is_content_and_counted(cluster: str) -> None:
    family = "mistral"  # the metric label: one name for both halves
    before = parse_errors(cluster, SMALL3).get((family, "invalid_tool_call"), 0.0)
    whole, folded = both(cluster, model=SMALL3, messages=user("mistral-bad"), tools=[WEATHER])
    assert_same(whole, folded)
    assert (
        whole.choices[0].message.content == 'get_weather{"city": }'
        and not whole.choices[0].message.tool_calls
    )
    assert parse_errors(cluster, SMALL3)[(family, "invalid_tool_call")] == before + 2  # both requests
    whole, _ = both(cluster, model=SMALL3, messages=user("mistral-typed"), tools=[WEATHER])
    assert whole.choices[0].message.content == "say [TOOL_CALLS]get_weather[ARGS]{} as text"
