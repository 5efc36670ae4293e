"""The HTTP app in-process (``serve_frontend`` on this test's event loop, uvicorn on a free port)
against real mock-worker processes, driven with httpx: every endpoint, every error code and body,
``x-request-id``. Waits are conditions polled with deadlines (the frontend runs on this loop, so
waiting must ``await``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import pytest_asyncio
from support.images import png_data_url
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint

from dynamo_prep.cli.render import render_request
from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.serve import serve_frontend
from dynamo_prep.tokenizer import Tokenizer

DEMO = "kimi-k3-demo"
K3_CONTEXT = 8192  # the demo's context length
BODY_LIMIT = 64 << 10
TIMEOUT_S = 20.0
DATA_IMAGE = {"type": "image_url", "image_url": {"url": png_data_url()}}  # a real picture: workers decode it
T = TypeVar("T")


@dataclass
class Frontend:
    url: str
    discovery: str
    http: httpx.AsyncClient
    workers: list[DynamoProcess]

    def worker(self, *extra: str, delay: str = "0", log_level: str = "info") -> DynamoProcess:
        args = ("--model-path", DEMO, "--discovery", self.discovery, "--token-delay", delay, *extra)
        proc = start_dynamo("worker", *args, log_level=log_level)
        self.workers.append(proc)
        return proc

    async def served(self, model: str = DEMO) -> None:
        async def listed() -> bool:
            answer = await self.http.get("/v1/models")
            return model in [entry["id"] for entry in answer.json()["data"]]

        await until(listed, f"{model} in /v1/models")


async def until(predicate: Callable[[], Awaitable[T]], what: str, timeout: float = TIMEOUT_S) -> T:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)  # polling interval of the condition


async def _frontend(tmp_path: Path) -> AsyncIterator[Frontend]:
    port, discovery = free_port(), tcp_endpoint()
    config = FrontendConfig.from_options(
        discovery_bind=discovery,
        cache_dir=tmp_path / "cache",
        http_host="127.0.0.1",
        http_port=port,
        max_body_bytes=BODY_LIMIT,
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(serve_frontend(config, stop=stop))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, trust_env=False) as http:
        frontend = Frontend(url, discovery, http, [])

        async def up() -> bool:
            try:
                return (await http.get("/live")).status_code == 200
            except httpx.TransportError:
                return False

        await until(up, "/live")
        try:
            yield frontend
        finally:
            for worker in frontend.workers:
                worker.stop()
            stop.set()
            assert await asyncio.wait_for(serving, TIMEOUT_S) == 0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fe(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Frontend]:
    """One frontend with an sglang worker of the demo model and a contract-breaking vllm worker."""
    async for frontend in _frontend(tmp_path_factory.mktemp("fe")):
        frontend.worker("--flavor", "sglang")
        # Declares SGLang's token while enforcing vLLM's contract: every image request is refused.
        # Slow (a text request takes ~1.5 s) and logging at debug, for the disconnect test.
        frontend.worker(
            "--flavor", "vllm", "--served-name", "breaker", "--declare-image-token", "<|media_pad|>",
            delay="0.05", log_level="debug",
        )  # fmt: skip
        await frontend.served()
        await frontend.served("breaker")
        yield frontend


pytestmark = pytest.mark.asyncio(loop_scope="module")


def chat(content: Any = "Hello there", **extra: Any) -> dict[str, Any]:
    return {"model": DEMO, "messages": [{"role": "user", "content": content}], **extra}


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


def sse_events(text: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


# -- happy paths ------------------------------------------------------------------------------------


async def test_non_streaming_completion_with_usage_and_request_ids(fe: Frontend) -> None:
    answer = await fe.http.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "my-id.1"})
    assert answer.status_code == 200
    assert answer.headers["x-request-id"] == "my-id.1"
    body = answer.json()
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-my-id.1"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].startswith("[mock sglang] 0 image(s)")
    assert choice["message"]["content"].endswith("You said: Hello there")
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    generated = await fe.http.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "bad id!"})
    assert len(generated.headers["x-request-id"]) == 32  # an unusable id is replaced


async def test_streaming_matches_non_streaming_and_reports_usage(fe: Frontend) -> None:
    plain = (
        await fe.http.post("/v1/chat/completions", json=chat([DATA_IMAGE, {"type": "text", "text": "x"}]))
    ).json()
    streamed = await fe.http.post(
        "/v1/chat/completions",
        json=chat(
            [DATA_IMAGE, {"type": "text", "text": "x"}], stream=True, stream_options={"include_usage": True}
        ),
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(streamed.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert "1 image(s)" in text
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    no_usage = sse_events((await fe.http.post("/v1/chat/completions", json=chat(stream=True))).text)
    assert all(chunk["usage"] is None for chunk in no_usage)


async def test_stop_strings_are_hidden_and_max_tokens_gives_length(fe: Frontend) -> None:
    stopped = (await fe.http.post("/v1/chat/completions", json=chat(stop=["You said"]))).json()
    content = stopped["choices"][0]["message"]["content"]
    assert "You said" not in content and content.startswith("[mock sglang]")
    assert stopped["choices"][0]["finish_reason"] == "stop"
    cut = (await fe.http.post("/v1/chat/completions", json=chat(max_completion_tokens=3))).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 3


async def test_models_tokenize_health_live(fe: Frontend) -> None:
    models = (await fe.http.get("/v1/models")).json()
    assert models["object"] == "list"
    entry = next(entry for entry in models["data"] if entry["id"] == DEMO)
    assert entry["object"] == "model" and entry["owned_by"] and isinstance(entry["created"], int)
    tokens = (await fe.http.post("/tokenize", json=chat())).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] > tokens["count"]
    completion = (await fe.http.post("/v1/chat/completions", json=chat())).json()
    assert completion["usage"]["prompt_tokens"] == tokens["count"]
    prompt = (await fe.http.post("/tokenize", json={"model": DEMO, "prompt": "hello"})).json()
    assert prompt["count"] == len(prompt["tokens"]) >= 1
    health = await fe.http.get("/health")
    assert health.status_code == 200 and DEMO in health.json()["models"]
    assert (await fe.http.get("/live")).status_code == 200


async def test_detokenize_gives_back_what_tokenize_took(fe: Frontend) -> None:
    text = "Hello there: ünïcode, 日本語, a typed <|im_end|> and\n  spaces "
    tokens = (await fe.http.post("/tokenize", json={"model": DEMO, "prompt": text})).json()["tokens"]
    answer = await fe.http.post("/detokenize", json={"model": DEMO, "tokens": tokens})
    assert answer.status_code == 200 and answer.json() == {"prompt": text}
    chat_ids = (await fe.http.post("/tokenize", json=chat())).json()["tokens"]
    rendered = (await fe.http.post("/detokenize", json={"model": DEMO, "tokens": chat_ids})).json()
    expected = render_request(chat(), model_path=DEMO, served_name=None, declared_token=None, hosted=False)
    assert rendered == {"prompt": expected["text"]}  # control tokens decode to their text
    assert "<|open|>" in rendered["prompt"]
    empty = await fe.http.post("/detokenize", json={"model": DEMO, "tokens": []})
    assert empty.json() == {"prompt": ""}


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (json.dumps({"model": DEMO, "messages": "hi"}).encode(), "Invalid request", "messages"),
        (
            json.dumps(chat([{"type": "audio", "x": 1}])).encode(),
            "unknown content part type 'audio'",
            "messages",
        ),
        (json.dumps(chat(max_tokens=10**6)).encode(), "maximum context length", "max_tokens"),
        (json.dumps(chat(n=0)).encode(), "n must be in [1, 16]", "n"),
        (
            json.dumps(chat([{"type": "image_url", "image_url": {"url": "ftp://x/a.png"}}])).encode(),
            "http(s) URL",
            "messages",
        ),
    ],
)
async def test_bad_requests_are_400_with_the_reason(
    fe: Frontend, body: bytes, message: str, param: str | None
) -> None:
    answer = await fe.http.post("/v1/chat/completions", content=body)
    error = error_of(answer, 400)
    assert message in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert "x-request-id" in answer.headers


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"tokens": [1]}, "missing required field `model`", "model"),
        ({"model": DEMO}, "missing required field `tokens`", "tokens"),
        ({"model": DEMO, "tokens": "1 2"}, "Expected `array`, got `str`", "tokens"),
        ({"model": DEMO, "tokens": [1, "2"]}, "at `$.tokens[1]`", "tokens"),
        ({"model": DEMO, "tokens": [1, 2.5]}, "Expected `int`, got `float`", "tokens"),
        ({"model": DEMO, "tokens": [True]}, "Expected `int`, got `bool`", "tokens"),
        ({"model": DEMO, "tokens": [2**64]}, "Expected `int` <=", "tokens"),
        ({"model": DEMO, "tokens": [1] * (K3_CONTEXT + 1)}, f"context length of {K3_CONTEXT}", "tokens"),
        ({"model": "", "tokens": [1]}, "at `$.model`", "model"),
    ],
)
async def test_bad_detokenize_requests_are_400_naming_the_parameter(
    fe: Frontend, body: dict[str, Any], message: str, param: str
) -> None:
    error = error_of(await fe.http.post("/detokenize", json=body), 400)
    assert message in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


async def test_detokenize_names_the_first_id_outside_the_vocabulary(
    fe: Frontend, k3_demo_tokenizer: Tokenizer
) -> None:
    size = k3_demo_tokenizer.n_vocab
    for tokens, bad in (([1, size, -1], size), ([5, -1, size + 9], -1), ([2**62], 2**62)):
        error = error_of(await fe.http.post("/detokenize", json={"model": DEMO, "tokens": tokens}), 400)
        assert f"token id {bad} is outside the vocabulary of {size} ids" in error["message"]
        assert error["param"] == "tokens"
    error_of(await fe.http.post("/detokenize", content=b"{not json"), 400)


async def test_engine_contract_violation_is_a_400(fe: Frontend) -> None:
    body = chat([DATA_IMAGE, {"type": "text", "text": "hi"}], model="breaker")
    error = error_of(await fe.http.post("/v1/chat/completions", json=body), 400)
    assert "Expected 1 occurrence(s) of the image placeholder" in error["message"]
    streamed = await fe.http.post("/v1/chat/completions", json={**body, "stream": True})
    assert "Expected 1 occurrence(s)" in error_of(streamed, 400)["message"]  # refused before streaming


async def test_unknown_model_is_404_listing_the_served_models(fe: Frontend) -> None:
    error = error_of(await fe.http.post("/v1/chat/completions", json=chat(model="gpt-9")), 404)
    assert "gpt-9" in error["message"] and DEMO in error["message"] and "breaker" in error["message"]
    assert error["param"] == "model"
    error_of(await fe.http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404)
    unknown = error_of(await fe.http.post("/detokenize", json={"model": "gpt-9", "tokens": [1]}), 404)
    assert "gpt-9" in unknown["message"] and unknown["param"] == "model"


async def test_body_limit_is_413_by_header_and_by_stream(fe: Frontend) -> None:
    big = json.dumps(chat("x" * BODY_LIMIT)).encode()
    assert "limit" in error_of(await fe.http.post("/v1/chat/completions", content=big), 413)["message"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies as it streams
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    error_of(await fe.http.post("/v1/chat/completions", content=chunked()), 413)


async def test_wrong_routes_are_404_and_405_with_openai_bodies(fe: Frontend) -> None:
    error_of(await fe.http.get("/v1/nothing"), 404)
    answer = await fe.http.get("/v1/chat/completions")
    error_of(answer, 405)
    assert "POST" in answer.headers["allow"]


async def test_health_is_503_until_a_model_is_live(tmp_path: Path) -> None:
    async for frontend in _frontend(tmp_path):
        health = await frontend.http.get("/health")
        assert health.status_code == 503 and health.json()["models"] == []
        assert (await frontend.http.get("/live")).status_code == 200
        error = error_of(await frontend.http.post("/v1/chat/completions", json=chat()), 503)
        assert error["type"] == "service_unavailable"
        assert (await frontend.http.get("/v1/models")).json()["data"] == []
        frontend.worker("--flavor", "vllm")
        await frontend.served()
        health = await frontend.http.get("/health")
        assert health.status_code == 200 and health.json()["models"] == [DEMO]
        answer = (await frontend.http.post("/v1/chat/completions", json=chat())).json()
        assert answer["choices"][0]["message"]["content"].startswith("[mock vllm]")


async def test_client_disconnect_cancels_the_generation_on_the_worker(fe: Frontend) -> None:
    breaker = fe.workers[1]
    body = chat(model="breaker")
    async with fe.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        async for _ in streamed.aiter_bytes():
            break  # the first chunk arrived: hang up mid-stream

    async def cancelled(count: int) -> bool:
        return len(breaker.find("request_finished", finish_reason="cancelled")) >= count

    await until(lambda: cancelled(1), "the streamed request cancelled on the worker")
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        await fe.http.post("/v1/chat/completions", json=body, timeout=0.5)
    await until(lambda: cancelled(2), "the non-streamed request cancelled on the worker")
