"""Pythonic tool calls end to end with the official ``openai`` client: a Llama 3 model served with
``--tool-call-parser pythonic`` and a Llama 4 model with ``--tool-call-parser llama4_pythonic``
(real vocabularies; ``<|python_start|>`` a special token), behind a real frontend. The mock writes
its calls as the declared parser reads them (``[get_weather(city='mock')]``); the frontend returns
them as OpenAI calls, streamed and not, through the Responses API as ``function_call`` items, and
under a forced ``tool_choice`` (the engine's grammar path). Malformed output is content, counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.hf_models import built_models
from test_answers_e2e import WEATHER, assert_same, both, calls_of, user
from test_answers_families_e2e import parse_errors

PYTHONIC = "llama3-pythonic"
LLAMA4 = "llama4-pythonic"
MODELS = (PYTHONIC, LLAMA4)
FAMILIES = {PYTHONIC: "pythonic", LLAMA4: "llama4_pythonic"}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "minLength": 5}},
            "required": ["zone"],
        },
    },
}
REPLIES = {
    "two-calls": [["[get_weather(city='Lima', days=2), get_time(zone=\"America/Lima\")]", False]],
    "not-a-call": [["[get_weather(city=lima)] is how I would call it", False]],
    "a-list": [["[1, 2, 3] are the first numbers", False]],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("pythonic")
    models = built_models()
    replies = directory / "replies.jsonl"
    lines = [{"when": when, "segments": segments} for when, segments in REPLIES.items()]
    replies.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    workers = [
        ("--model-path", str(models["llama3"]), "--served-name", PYTHONIC, "--tool-call-parser", "pythonic"),
        (
            "--model-path",
            str(models["llama4"]),
            "--served-name",
            LLAMA4,
            "--tool-call-parser",
            "llama4_pythonic",
        ),
    ]
    with mock_cluster(directory, [(*flags, "--replies", str(replies)) for flags in workers]) as running:
        yield running


@pytest.mark.parametrize("model", MODELS)
def test_the_mock_s_call_is_read_streamed_and_not(cluster: str, model: str) -> None:
    whole, folded = both(cluster, model=model, messages=user("Weather in Paris?"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert calls_of(message) == [("get_weather", {"city": "mock", "days": 1})]
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("model", MODELS)
def test_several_calls_and_what_is_no_call(cluster: str, model: str) -> None:
    whole, folded = both(cluster, model=model, messages=user("two-calls"), tools=[WEATHER, TIME])
    assert_same(whole, folded)
    assert calls_of(whole.choices[0].message) == [
        ("get_weather", {"city": "Lima", "days": 2}),
        ("get_time", {"zone": "America/Lima"}),
    ]
    before = parse_errors(cluster, model).get((FAMILIES[model], "invalid_tool_call"), 0.0)
    whole, folded = both(cluster, model=model, messages=user("not-a-call"), tools=[WEATHER])
    assert_same(whole, folded)
    assert whole.choices[0].message.content == "[get_weather(city=lima)] is how I would call it"
    assert parse_errors(cluster, model)[(FAMILIES[model], "invalid_tool_call")] == before + 2  # both requests
    whole, _ = both(cluster, model=model, messages=user("a-list"), tools=[WEATHER])
    assert whole.choices[0].message.content == "[1, 2, 3] are the first numbers"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_a_declared_tool_with_valid_arguments(
    cluster: str, model: str, stream: bool
) -> None:
    """``zone`` needs 5 characters: the mock's free call (``"mock"``) would not validate; the engine's
    grammar answers ``[{"name", "parameters"}]``, which the pythonic parser leaves to the forced reader."""
    asked: dict[str, Any] = {
        "model": model,
        "messages": user("What time is it?"),
        "tools": [TIME, WEATHER],
        "tool_choice": "required",
    }
    whole, folded = both(cluster, **asked)
    assert_same(whole, folded)
    calls = calls_of(whole.choices[0].message)
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}  # type: ignore[index]
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])


@pytest.mark.parametrize("model", MODELS)
def test_a_named_tool_choice_calls_that_tool(cluster: str, model: str) -> None:
    reply = client(cluster).chat.completions.create(
        model=model,
        messages=user("What time is it?"),  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])  # type: ignore[union-attr,index]
    assert reply.choices[0].message.content in (None, "")


@pytest.mark.parametrize("model", MODELS)
def test_the_responses_api_returns_function_call_items(cluster: str, model: str) -> None:
    response = client(cluster).responses.create(
        model=model,
        input="two-calls",
        tools=[{"type": "function", **f["function"]} for f in (WEATHER, TIME)],  # type: ignore[misc]
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima", "days": 2}),
        ("get_time", {"zone": "America/Lima"}),
    ]
    assert all(c.call_id.startswith("call_") for c in calls)
