"""End to end with the official ``openai`` client: a ``dynamo-prep frontend`` process, real mock
workers of both flavors, real HTTP. Plus ``dynamo-prep up``: ready, its printed curl works, and
SIGTERM leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.cluster import Processes
from support.images import CAT_PNG, png_data_url, served_images
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

DEMO = "kimi-k3-demo"
DATA_IMAGE = {"type": "image_url", "image_url": {"url": png_data_url()}}
# The mixed cluster's workers fetch http images from this test's server on loopback.
LOOPBACK_MEDIA = ("--allowed-media-networks", "127.0.0.1/32")
REPLY = re.compile(r"^\[mock (\w+)\] (\d+) image\(s\)")


class Cluster(Processes):
    """A frontend process and its workers; ``client`` speaks to it through the openai package."""

    def worker(self, flavor: str, *extra: str) -> DynamoProcess:
        return self.start_worker("--model-path", DEMO, "--flavor", flavor, *extra)

    def wait_instances(self, count: int) -> None:
        assert self.frontend is not None
        wait_for(lambda: len(self.frontend.find("instance_added")) >= count, 20, message="instances")  # type: ignore[union-attr]
        wait_for(lambda: self.frontend.find("model_added"), 20, message="model_added")  # type: ignore[union-attr]

    def client(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, http_client=_http(), **options
        )

    def async_client(self) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(trust_env=False, timeout=30)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, http_client=http)


def _http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=30)


@pytest.fixture(scope="module")
def http_image() -> Iterator[dict[str, Any]]:
    """An http image part whose picture a server on loopback serves while the module runs."""
    with served_images({"/cat.png": CAT_PNG}) as base:
        yield {"type": "image_url", "image_url": {"url": f"{base}/cat.png"}}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, http_image: dict[str, Any]) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("mixed"))
    try:
        cluster.start_frontend(log_level="debug")
        cluster.worker("sglang", "--token-delay", "0", *LOOPBACK_MEDIA)
        cluster.worker("vllm", "--token-delay", "0", *LOOPBACK_MEDIA)
        cluster.wait_instances(2)
        yield cluster
    finally:
        cluster.stop()


def ask(*content: Any, text: str = "Describe them.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def test_non_streaming_and_streaming(mixed: Cluster) -> None:
    client = mixed.client()
    plain = client.chat.completions.create(model=DEMO, messages=ask(text="Hi there"))  # type: ignore[arg-type]
    content = plain.choices[0].message.content or ""
    assert REPLY.match(content) and content.endswith("You said: Hi there")
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage is not None and plain.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=DEMO,
        messages=ask(text="Hi there"),  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert REPLY.match(text) and text.endswith("You said: Hi there")
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"


def test_two_images_are_served_by_each_flavor(mixed: Cluster, http_image: dict[str, Any]) -> None:
    client = mixed.client()
    served = set()
    for _ in range(2):
        answer = client.chat.completions.create(
            model=DEMO,
            messages=ask(http_image, DATA_IMAGE),  # type: ignore[arg-type]
        )
        match = REPLY.match(answer.choices[0].message.content or "")
        assert match is not None and match[2] == "2"
        served.add(match[1])
    assert served == {"sglang", "vllm"}


def test_errors_map_to_the_clients_exception_types(mixed: Cluster) -> None:
    client = mixed.client()
    with pytest.raises(openai.BadRequestError, match="unknown content part type"):
        client.chat.completions.create(model=DEMO, messages=ask({"type": "video", "url": "x"}))  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match=DEMO):
        client.chat.completions.create(model="nope", messages=ask())  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=DEMO, messages=ask(), max_tokens=10**7)  # type: ignore[arg-type]
    models = client.models.list()
    assert [model.id for model in models.data] == [DEMO]


def test_mixed_pool_serves_50_image_requests_without_contract_errors(
    mixed: Cluster, http_image: dict[str, Any]
) -> None:
    async def run() -> list[str]:
        client = mixed.async_client()
        gate = asyncio.Semaphore(8)

        async def one(index: int) -> str:
            async with gate:
                images = [http_image] * (1 + index % 3)
                answer = await client.chat.completions.create(
                    model=DEMO,
                    messages=ask(*images, text=f"request {index}"),  # type: ignore[arg-type]
                    max_tokens=40,
                )
                content = answer.choices[0].message.content or ""
                match = REPLY.match(content)
                assert match is not None and int(match[2]) == len(images), content
                return match[1]

        try:
            return await asyncio.gather(*(one(index) for index in range(50)))
        finally:
            await client.close()

    flavors = asyncio.run(run())
    assert flavors.count("sglang") == flavors.count("vllm") == 25
    for proc in mixed.procs[1:]:
        assert not proc.find("mock_contract_violation")


def test_worker_killed_mid_stream(tmp_path: Path) -> None:
    """SIGKILL the worker serving a stream: the stream migrates (or ends with a clean error), and
    the frontend keeps serving."""
    cluster = Cluster(tmp_path)
    try:
        frontend = cluster.start_frontend(log_level="debug")
        options = ("--token-delay", "0.05", "--migration-limit", "1", "--heartbeat", "0.2", "--ttl-ms", "800")
        workers = [cluster.worker("sglang", *options) for _ in range(2)]
        cluster.wait_instances(2)
        client = cluster.client()
        reference = client.chat.completions.create(model=DEMO, messages=ask(text="keep talking"))  # type: ignore[arg-type]
        expected = reference.choices[0].message.content or ""
        by_instance = {proc.wait_event("worker_started")["instance_id"]: proc for proc in workers}
        stream = client.chat.completions.create(
            model=DEMO,
            messages=ask(text="keep talking"),  # type: ignore[arg-type]
            stream=True,
        )
        text, error = "", None
        try:
            for index, chunk in enumerate(stream):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                if index == 3:
                    routed = frontend.find("request_routed")[-1]
                    by_instance[routed["instance_id"]].kill()
        except openai.APIError as exc:
            error = exc
        if error is None:
            assert text == expected  # migrated: the continuation picks up exactly where it stopped
            assert frontend.find("request_migrated")
        else:
            assert "worker" in str(error)
        after = client.chat.completions.create(model=DEMO, messages=ask(text="still there?"))  # type: ignore[arg-type]
        assert (after.choices[0].message.content or "").endswith("still there?")
    finally:
        cluster.stop()


def sse_text(body: str) -> str:
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])


def test_up_serves_its_curl_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    watch_address = tcp_endpoint()
    up = start_dynamo(
        "up", "--http-port", str(port), "--discovery-bind", tcp_endpoint(), "--log-dir", str(tmp_path),
        "--watch-address", watch_address, log_level="info",
    )  # fmt: skip
    watch: DynamoProcess | None = None
    try:
        wait_for(lambda: len([line for line in up.raw if line.startswith("curl ")]) == 6, 60, message="curls")
        children = [event["pid"] for event in up.find("up_child_started")]
        assert len(children) == 4
        image_curl, call_curl, result_curl, llama_call_curl, llama_result_curl, structured_curl = [
            line for line in up.raw if line.startswith("curl ")
        ]
        served = []
        for _ in range(2):  # the same prompt twice: KV routing sends it back where it is cached
            out = subprocess.run(
                shlex.split(image_curl), capture_output=True, text=True, timeout=30, check=True
            ).stdout
            assert out.rstrip().endswith("data: [DONE]"), out
            match = REPLY.match(sse_text(out))
            assert match is not None and match[2] == "1", out[:400]
            served.append(match[1])
        assert served[0] == served[1]
        # The tool-calling exchange it prints: a call of get_weather, then the answer to its result;
        # a new prompt, so it goes to the other worker (nobody caches half of it: the least loaded).
        called = json.loads(
            subprocess.run(
                shlex.split(call_curl), capture_output=True, text=True, timeout=30, check=True
            ).stdout
        )
        assert called["choices"][0]["finish_reason"] == "tool_calls"
        assert called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        answered = json.loads(
            subprocess.run(
                shlex.split(result_curl), capture_output=True, text=True, timeout=30, check=True
            ).stdout
        )
        content = answered["choices"][0]["message"]["content"]
        assert "sunny, 21 C" in content
        assert {served[0], content.split("]")[0].removeprefix("[mock ")} == {"sglang", "vllm"}
        # The Llama-3-style exchange: llama3-demo's worker declares --tool-call-parser llama3_json.
        assert '"model": "llama3-demo"' in llama_call_curl
        called = json.loads(
            subprocess.run(
                shlex.split(llama_call_curl), capture_output=True, text=True, timeout=30, check=True
            ).stdout
        )
        assert called["choices"][0]["finish_reason"] == "tool_calls"
        assert called["choices"][0]["message"]["content"] is None
        [call] = called["choices"][0]["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
            "get_weather",
            {"city": "mock"},
        )
        answered = json.loads(
            subprocess.run(
                shlex.split(llama_result_curl), capture_output=True, text=True, timeout=30, check=True
            ).stdout
        )
        assert answered["choices"][0]["message"]["content"].endswith("] the tool returned: sunny, 21 C")
        # The structured output it prints: JSON under its schema (docs/structured-outputs.md).
        structured = json.loads(
            subprocess.run(
                shlex.split(structured_curl), capture_output=True, text=True, timeout=30, check=True
            ).stdout
        )
        assert set(json.loads(structured["choices"][0]["message"]["content"])) == {"city", "sky", "celsius"}
        up_frontend = (tmp_path / "frontend.log").read_text()
        assert '"kv_overlap_blocks"' in up_frontend and '"router_mode": "kv"' in up_frontend
        assert f"dynamo-prep watch --bind {watch_address}" in "\n".join(up.raw)
        # The printed watch command shows the running cluster at once: both workers, each its token.
        watch = start_dynamo("watch", "--bind", watch_address, "--json", log_level="info")

        def both_workers() -> set[str] | None:
            assert watch is not None
            found = {event["declared"] for event in watch.find("instance_added")}
            return found if len(found) == 2 else None

        tokens = wait_for(both_workers, 20, message="both up workers in watch")
        assert tokens == {"<|media_pad|>", "checkpoint default"}
        up.signal(signal.SIGTERM)
        assert up.wait(20) == 0
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert (tmp_path / "frontend.log").stat().st_size > 0
    finally:
        up.stop()
        if watch is not None:
            watch.stop()
