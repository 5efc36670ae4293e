"""``dynamo-prep worker --replies FILE --reply-format model``: real worker processes on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.plane import DynamoProcess, SubCollector, start_dynamo, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.engines.mock import MockEngine
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.preprocessed import PreprocessedRequest

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REPLIES = [
    {"when": "scripted", "segments": [["Scripted ", False], ["<|close|>", True], ["<|close|>", False]]},
    {"when": "never", "text": "not this one"},
]


@pytest.fixture
def plane() -> Iterator[str]:
    address = tcp_endpoint()
    with SubCollector(address, bind=True):
        yield address


@pytest.fixture
async def client() -> AsyncIterator[RequestPlaneClient]:
    client = RequestPlaneClient()
    yield client
    await client.close()


@pytest.fixture
def replies(tmp_path: Path) -> Path:
    path = tmp_path / "replies.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in REPLIES), encoding="utf-8")
    return path


def preprocess(text: str, **fields: Any) -> PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(
        DEMO, runtime_config=ModelRuntimeConfig(image_placeholder_token=MEDIA_PAD)
    )
    messages = [{"role": "user", "content": text}]
    return OpenAIPreprocessor.new(card, DEMO).preprocess({"model": DEMO, "messages": messages, **fields})


def start_worker(procs: list[DynamoProcess], plane: str, *extra: str) -> str:
    worker = start_dynamo("worker", "--model-path", DEMO, "--discovery", plane, "--token-delay", "0", *extra)
    procs.append(worker)
    return str(worker.wait_event("worker_started")["endpoint"])


async def test_a_worker_streams_scripted_replies_and_model_format_answers(
    plane: str, procs: list[DynamoProcess], client: RequestPlaneClient, replies: Path
) -> None:
    endpoint = start_worker(procs, plane, "--replies", str(replies), "--reply-format", "model")
    expected = MockEngine(DEMO, flavor="sglang", replies=replies, reply_format="model")
    close_id = expected.tokenizer.special_tokens["<|close|>"]
    for request_id, request in (
        ("scripted", preprocess("a scripted answer, please")),
        ("model", preprocess("What is the weather in Paris?", tools=[WEATHER])),
    ):
        outputs = [o async for o in client.generate(endpoint, request, request_id=request_id, timeout_s=10)]
        token_ids = [t for o in outputs for t in o.token_ids]
        assert (token_ids, outputs[-1].finish_reason) == expected.plan(request)
        assert close_id in token_ids
    assert 'call tool="get_weather"' in expected.tokenizer.decode(token_ids)


async def test_the_default_reply_format_is_the_plain_echo(
    plane: str, procs: list[DynamoProcess], client: RequestPlaneClient
) -> None:
    endpoint = start_worker(procs, plane)
    request = preprocess("Hello", tools=[WEATHER])
    outputs = [o async for o in client.generate(endpoint, request, request_id="echo", timeout_s=10)]
    text = MockEngine(DEMO, flavor="sglang").tokenizer.decode([t for o in outputs for t in o.token_ids])
    assert text == f"[mock sglang] 0 image(s), {len(request.token_ids)} prompt tokens. You said: Hello"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ('{"when": "a", "text": "ok"}\n{"when": "b"}\n', ":2: give exactly one of segments, text, token_ids"),
        ('{"when": "a", "token_ids": [1, 99999]}\n', ":1: token id 99999 is outside the vocabulary"),
    ],
)
def test_a_bad_replies_file_fails_start_up_naming_the_line(
    tmp_path: Path, procs: list[DynamoProcess], content: str, error: str
) -> None:
    path = tmp_path / "replies.jsonl"
    path.write_text(content, encoding="utf-8")
    args = ("--model-path", DEMO, "--discovery", tcp_endpoint(), "--replies", str(path))
    worker = start_dynamo("worker", *args, log_level="info")
    procs.append(worker)
    assert worker.wait(10) == 1
    [failure] = worker.find("worker_start_failed")
    assert failure["level"] == "error"
    assert f"{path}{error}" in failure["error"]
    assert not worker.find("worker_started")
