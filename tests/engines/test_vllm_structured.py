"""Structured outputs on a real vLLM (docs/structured-outputs.md): the frontend's constraint becomes
vLLM's own ``StructuredOutputsParams`` and a random-weight model answers JSON that validates.

vLLM builds grammars over its own tokenizer, so this engine loads one (a ``tokenizer.json``
converted from the demo vocabulary: ``make_engine_model.py --tokenizer-json``; no
``--skip-tokenizer-init``), with the xgrammar backend and no free whitespace (with free whitespace
a random model writes blanks inside ``{`` until max_tokens). Every string and number in the
schemas is bounded, so the JSON ends within max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import ENGINE_START_S, VLLM_FLAGS, _engine_model_module, wait_serving
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint

MODEL = "engmodel-structured"
STRUCTURED_CONFIG = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["city", "town"]},
        "rank": {"type": "integer", "minimum": 0, "maximum": 9},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "kind", "rank", "coastal"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "maximum": 7, "minimum": 1},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "Describe a city."}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A frontend and one vLLM worker whose engine loads its own tokenizer."""
    model = _engine_model_module().write_engine_model(
        tmp_path_factory.mktemp("models") / MODEL, tokenizer_json=True
    )
    discovery, http_port = tcp_endpoint(), free_port()
    frontend = start_dynamo(
        "frontend",
        "--discovery-bind",
        discovery,
        "--http-port",
        str(http_port),
        "--cache-dir",
        str(tmp_path_factory.mktemp("cache")),
        log_level="debug",
    )
    flags = [flag for flag in VLLM_FLAGS if flag != "--skip-tokenizer-init"]
    worker: DynamoProcess = start_dynamo(
        "worker",
        "--engine",
        "vllm",
        "--model-path",
        str(model),
        "--discovery",
        discovery,
        "--metrics-port",
        "0",
        *flags,
        "--structured-outputs-config",
        STRUCTURED_CONFIG,
        log_level="debug",
    )
    try:
        frontend.wait_event("frontend_started", timeout=60)
        started = worker.wait_event("worker_started", timeout=ENGINE_START_S)
        wait_serving(frontend, started["instance_id"])
        yield f"http://127.0.0.1:{http_port}/v1"
    finally:
        worker.stop(timeout=60)
        frontend.stop(timeout=30)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base_url,
        api_key="none",
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )


def model_id(base_url: str) -> str:
    return client(base_url).models.list().data[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates(base_url: str, stream: bool) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": True},
    }
    asked: dict[str, Any] = {
        "model": model_id(base_url),
        "messages": USER,
        "response_format": response_format,
        "max_tokens": 120,
        "temperature": 0,
    }
    if stream:
        chunks = list(client(base_url).chat.completions.create(**asked, stream=True))
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
    else:
        answer = client(base_url).chat.completions.create(**asked)
        content, finish = answer.choices[0].message.content or "", answer.choices[0].finish_reason
    assert finish == "stop", content
    jsonschema.validate(json.loads(content), CITY)


def test_a_free_answer_of_the_same_model_is_not_json(base_url: str) -> None:
    """The constraint is the engine's: unconstrained, the random model writes no such JSON."""
    answer = client(base_url).chat.completions.create(
        model=model_id(base_url),
        messages=USER,
        max_tokens=40,
        temperature=0,  # type: ignore[arg-type]
    )
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), CITY)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_forced_tool_choice_is_a_call_with_valid_arguments(base_url: str, tool_choice: Any) -> None:
    answer = client(base_url).chat.completions.create(
        model=model_id(base_url),
        messages=USER,  # type: ignore[arg-type]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = answer.choices[0].message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_weather"], answer  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOL["function"]["parameters"])  # type: ignore[union-attr,index]


def test_the_engine_model_s_tokenizer_json_has_our_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    from dynamo_prep.tokenizer import Tokenizer  # noqa: PLC0415

    model = _engine_model_module().write_engine_model(tmp_path / MODEL, tokenizer_json=True)
    theirs = AutoTokenizer.from_pretrained(str(model))
    ours = Tokenizer.from_model_dir(model)
    text = '{"name": "Oslo", "rank": [1, 22]} café <|im_end|>'
    assert theirs.encode(text) == ours.encode(text, allow_special=True)
