"""Parsers chosen by the worker's flags, end to end with the official ``openai`` client: a Llama 3
model (real vocabulary, ``<|python_tag|>`` a special token) served with ``--tool-call-parser
llama3_json``, and the same directory under another name with ``--reasoning-parser deepseek_r1``
as well. Streamed and not, the same answer; malformed output is content, counted by family."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.hf_models import built_models
from test_answers_e2e import WEATHER, assert_same, both, calls_of, user

LLAMA = "llama3-tools"
LLAMA_R1 = "llama3-r1"
TAG, EOM = ["<|python_tag|>", True], ["<|eom_id|>", True]


def text(value: str) -> list[Any]:
    return [value, False]


REPLIES = {
    "llama-call": [TAG, text('{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}'), EOM],
    "llama-two": [
        text('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '),
        text('{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}'),
    ],
    "llama-text": [text("It is sunny in Lima {not a call}.")],
    "llama-builtin": [TAG, text('brave_search.call(query="weather")'), EOM],
    "llama-think": [
        text("The user wants weather.</think>"),
        text('{"name": "get_weather", "parameters": {"city": "Quito"}}'),
    ],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("families")
    model = built_models()["llama3"]
    replies = directory / "replies.jsonl"
    lines = [{"when": when, "segments": segments} for when, segments in REPLIES.items()]
    replies.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    common = ("--model-path", str(model), "--replies", str(replies), "--tool-call-parser", "llama3_json")
    workers = [
        (*common, "--served-name", LLAMA),
        (*common, "--served-name", LLAMA_R1, "--reasoning-parser", "deepseek_r1"),
    ]
    with mock_cluster(directory, workers) as running:
        yield running


def parse_errors(url: str, model: str) -> dict[tuple[str, str], float]:
    with httpx.Client(trust_env=False, timeout=30) as http:
        lines = http.get(f"{url}/metrics").text.splitlines()
    found: dict[tuple[str, str], float] = {}
    for line in lines:
        if line.startswith("dynamo_frontend_output_parse_errors_total{") and f'model="{model}"' in line:
            labels = dict(
                part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            key = (labels["family"].strip('"'), labels["kind"].strip('"'))
            found[key] = float(line.rsplit(" ", 1)[1])
    return found


def test_llama3_json_calls_streamed_and_not(cluster: str) -> None:
    whole, folded = both(cluster, model=LLAMA, messages=user("llama-call"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert calls_of(message) == [("get_weather", {"city": "Lima", "days": 2})]
    assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls[0].id.startswith("call_")
    whole, folded = both(cluster, model=LLAMA, messages=user("llama-two"), tools=[WEATHER])
    assert_same(whole, folded)
    assert calls_of(whole.choices[0].message) == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome", "days": 1}),
    ]


def test_text_is_content_and_without_tools_json_is_not_a_call(cluster: str) -> None:
    whole, folded = both(cluster, model=LLAMA, messages=user("llama-text"), tools=[WEATHER])
    assert_same(whole, folded)
    assert whole.choices[0].message.content == "It is sunny in Lima {not a call}."
    whole, folded = both(cluster, model=LLAMA, messages=user("llama-two"))  # no tools declared
    assert_same(whole, folded)
    assert not whole.choices[0].message.tool_calls and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content.startswith('{"name": "get_weather"')


def test_a_builtin_tool_call_is_content_without_the_tag_and_counted(cluster: str) -> None:
    before = parse_errors(cluster, LLAMA).get(("llama3_json", "invalid_tool_call"), 0.0)
    whole, folded = both(cluster, model=LLAMA, messages=user("llama-builtin"), tools=[WEATHER])
    assert_same(whole, folded)
    assert whole.choices[0].message.content == 'brave_search.call(query="weather")'
    assert parse_errors(cluster, LLAMA)[("llama3_json", "invalid_tool_call")] == before + 2  # both requests


def test_the_declared_reasoning_parser_composes_with_the_tool_parser(cluster: str) -> None:
    whole, folded = both(cluster, model=LLAMA_R1, messages=user("llama-think"), tools=[WEATHER])
    assert_same(whole, folded)
    message = whole.choices[0].message
    assert message.reasoning_content == "The user wants weather."
    assert calls_of(message) == [("get_weather", {"city": "Quito"})]
    whole, _ = both(cluster, model=LLAMA, messages=user("llama-think"), tools=[WEATHER])
    assert whole.choices[0].message.content.startswith(
        "The user wants weather.</think>"
    )  # no reasoning parser


def test_the_responses_api_reads_the_same_calls(cluster: str) -> None:
    response = client(cluster).responses.create(
        model=LLAMA, input="llama-call", tools=[{"type": "function", **WEATHER["function"]}]
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima", "days": 2})
    ]
