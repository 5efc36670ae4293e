"""Hung engine cores and structured streams on a real vLLM (issue 25, rows 9 and 12).

Two ``dynamo-prep worker --engine vllm`` processes (``--migration-limit 1``) announce through a
broker, so each test starts a frontend of its own with the deadlines it needs against the same
engines (their tiny model loads its own tokenizer, for xgrammar). An engine core is hung the way
the issue did it: SIGSTOP to the worker's ``VLLM::EngineCore`` child, the worker's own process
untouched (its heartbeats and request plane go on). The last test leaves one worker exited.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import ENGINE_START_S, VLLM_FLAGS, _engine_model_module, children
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

MODEL = "engmodel-faults"
STRUCTURED_CONFIG = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
# Long enough to be interrupted on a CPU, bounded so that a random model's JSON ends.
RECORD = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "minLength": 16, "maxLength": 20} for i in range(8)},
    "required": [f"field_{i}" for i in range(8)],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
USER = [{"role": "user", "content": "Describe a record."}]


@dataclass
class Engine:
    process: DynamoProcess
    instance_id: str

    def core(self) -> int:
        """The pid of this worker's vLLM engine core (its ``VLLM::EngineCore`` child)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if parent == self.process.pid and cmdline.startswith(b"VLLM::EngineCore"):
                return int(entry.name)
        raise AssertionError(f"no VLLM::EngineCore child of {self.process.pid}")


@dataclass
class Plane:
    xpub: str
    engines: list[Engine]
    tmp: pytest.TempPathFactory

    def frontend(self, *flags: str) -> tuple[DynamoProcess, openai.OpenAI]:
        port = free_port()
        process = start_dynamo(
            "frontend", "--discovery", self.xpub, "--http-port", str(port), "--http-host", "127.0.0.1",
            "--cache-dir", str(self.tmp.mktemp("cache")), *flags, log_level="debug",
        )  # fmt: skip
        process.wait_event("model_added", timeout=60)
        for engine in self.engines:
            if engine.process.process.poll() is None:
                process.wait_event("instance_added", timeout=60, instance_id=engine.instance_id)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="none",
            max_retries=0,
            timeout=180,
            http_client=httpx.Client(trust_env=False, timeout=180),
        )
        return process, client

    def first(self) -> Engine:
        """The engine a fresh frontend's round robin picks first (the smallest instance id)."""
        return min(self.engines, key=lambda engine: engine.instance_id)

    def by_id(self, instance_id: str) -> Engine:
        return next(engine for engine in self.engines if engine.instance_id == instance_id)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    model = _engine_model_module().write_engine_model(
        tmp_path_factory.mktemp("models") / MODEL, tokenizer_json=True
    )
    xsub, xpub = tcp_endpoint(), tcp_endpoint()
    broker = start_dynamo("broker", "--xsub", xsub, "--xpub", xpub, log_level="info")
    flags = [flag for flag in VLLM_FLAGS if flag != "--skip-tokenizer-init"]
    worker_args = ("worker", "--engine", "vllm", "--model-path", str(model), "--discovery", xsub,
                   "--migration-limit", "1", "--drain-timeout", "5", *flags,
                   "--structured-outputs-config", STRUCTURED_CONFIG)  # fmt: skip
    workers = [start_dynamo(*worker_args, log_level="debug") for _ in range(2)]
    try:
        broker.wait_event("broker_started", timeout=30)
        engines = [
            Engine(worker, worker.wait_event("worker_started", timeout=ENGINE_START_S)["instance_id"])
            for worker in workers
        ]
        yield Plane(xpub, engines, tmp_path_factory)
    finally:
        for worker in workers:
            for engine_pid in children(worker.pid):
                os.kill(engine_pid, signal.SIGCONT)
            worker.stop(timeout=60)
        broker.stop()


def test_a_structured_stream_is_not_continued_on_another_engine(plane: Plane) -> None:
    """A json_schema stream's engine core is stopped after a few tokens; the frontend's stall
    deadline gives up on it. With a move allowed, the stream is still not continued on the other
    engine (its grammar would start again from the schema's root after the text sent: two JSON
    texts glued): the client gets an error event, and what it got is the start of an answer."""
    frontend, client = plane.frontend("--stream-stall-timeout", "3")
    engine = plane.first()
    core = engine.core()
    content, error, chunks = "", None, 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format=RESPONSE_FORMAT,
        max_tokens=200,
        temperature=0,
        stream=True,
    )  # type: ignore[call-overload]
    try:
        for chunk in stream:
            content += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            chunks += 1
            if chunks == 4:
                os.kill(core, signal.SIGSTOP)
    except openai.APIError as exc:
        error = exc
    finally:
        os.kill(core, signal.SIGCONT)  # the engine goes on; the frontend holds the worker aside for 30 s
    refused = frontend.wait_event("migration_refused", timeout=30)
    assert refused["reason"] == "constrained_output" and refused["streamed_tokens"] >= 1
    assert error is not None and "structured output" in str(error), (error, content)
    assert content.startswith("{") and not frontend.find("request_migrated")
    frontend.stop()


def test_a_structured_request_that_streamed_nothing_moves_and_validates(plane: Plane) -> None:
    """The engine core a fresh frontend routes to first is stopped before the request: no token
    comes, its heartbeat says its engine makes no step, and the request moves (for free) to the
    other engine, which answers JSON that validates."""
    frontend, client = plane.frontend("--first-token-timeout", "4")
    engine = plane.first()
    core = engine.core()
    os.kill(core, signal.SIGSTOP)
    try:
        answer = client.chat.completions.create(
            model=MODEL, messages=USER, response_format=RESPONSE_FORMAT, max_tokens=200, temperature=0
        )  # type: ignore[call-overload]
    finally:
        os.kill(core, signal.SIGCONT)
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), RECORD)
    moved = frontend.wait_event("request_migrated", timeout=10)
    assert moved["from_instance_id"] == engine.instance_id
    assert moved["streamed_tokens"] == 0 and moved["free"] is True
    frontend.stop()


def test_a_stopped_engine_core_mid_stream_is_failed_over_by_its_worker(plane: Plane) -> None:
    """Row 9 as the issue measured it: SIGSTOP to the engine core serving a stream (before: the
    stream stalled until the request timeout, the worker heartbeating and logging nothing). With
    the frontend's own deadlines far away, the worker's watchdog sees its engine make no step,
    withdraws, fails the stream over (503) and exits 1; the stream ends on the other engine with
    every token it asked for."""
    frontend, client = plane.frontend("--stream-stall-timeout", "600", "--first-token-timeout", "600")
    engine = plane.first()
    core = engine.core()
    finishes, usage = [], None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A long answer, please."}],
        max_tokens=300,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunks, chunk in enumerate(stream, start=1):
        if chunks == 4:
            os.kill(core, signal.SIGSTOP)
        if chunk.choices and chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == 300
    stalled = engine.process.wait_event("engine_stalled", timeout=60)
    assert stalled["in_flight"] == 1
    assert engine.process.wait(timeout=120) == 1
    moved = frontend.wait_event("request_migrated", timeout=10)
    assert moved["from_instance_id"] == engine.instance_id and moved["streamed_tokens"] >= 1
    wait_for(lambda: not Path(f"/proc/{core}").exists(), 60, message="the stopped engine core to be gone")
    frontend.stop()
