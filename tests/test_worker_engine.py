"""A real-engine worker's lifecycle without an engine: ``dynamo-prep worker --engine vllm`` with a
runtime shaped like the bridges' (``EngineRuntime``) in place of vLLM. SIGTERM withdraws the card,
drains (an in-flight request finishes), closes the request plane, and only then shuts the engine
down; an engine that dies makes the worker withdraw and exit 1. ``make test-engines`` runs the
same against a real vLLM."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.logs import Logs, find, until
from support.plane import tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.engines.base import EngineFacts
from dynamo_prep.engines.steps import EngineStep
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.lifecycle import EXIT_FAILED, EXIT_OK
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.worker import process
from dynamo_prep.worker.config import WorkerConfig
from dynamo_prep.worker.engine import engine_card

DEMO = "qwen-vl-demo"


class FakeRuntime:
    """What a bridge's runtime presents: here each request streams slowly until released."""

    flavor = "vllm"
    declared_image_token = None

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.release = asyncio.Event()
        self.dead = asyncio.Event()
        self.running = 0
        self.facts = EngineFacts(
            block_size=32,
            total_kv_blocks=640,
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            context_length=4096,
        )

    def check(self, request: Any) -> None:
        del request

    async def generate(self, request: Any) -> AsyncIterator[EngineStep]:
        del request
        self.running += 1
        try:
            yield EngineStep([11], None, 5, 1)
            await self.release.wait()
            yield EngineStep([12], "length", 5, 2)
        finally:
            self.running -= 1

    def unfinished_requests(self) -> int:
        return self.running

    async def wait_dead(self) -> str:
        await self.dead.wait()
        return "engine_core_dead"

    async def shutdown(self) -> None:
        self.order.append("engine_shutdown")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime([])
    monkeypatch.setattr(process, "start_runtime", lambda config: fake)
    return fake


def config() -> WorkerConfig:
    return WorkerConfig.from_options(
        model_path=DEMO, discovery=[tcp_endpoint()], engine="vllm", engine_args=["--block-size", "32"]
    )


async def test_sigterm_withdraws_drains_then_shuts_the_engine_down(logs: Logs, runtime: FakeRuntime) -> None:
    serving = asyncio.create_task(process._serve_engine(config()))
    started = await until(lambda: find(logs, "worker_started"), "worker_started")
    assert started[0]["declared_token"] is None
    card = ModelDeploymentCard.from_model_dir(DEMO)
    request = OpenAIPreprocessor.new(card, DEMO).preprocess(
        {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    client = RequestPlaneClient()
    stream = client.generate(started[0]["endpoint"], request, request_id="in-flight", timeout_s=30)
    assert (await anext(stream)).token_ids == [11]
    os.kill(os.getpid(), signal.SIGTERM)  # the worker's main process (this one)
    await until(lambda: find(logs, "worker_draining"), "worker_draining")
    runtime.release.set()  # the in-flight request finishes during the drain
    assert [output.token_ids async for output in stream] == [[12]]
    assert await asyncio.wait_for(serving, 30) == EXIT_OK
    await client.close()
    events = [
        line["event"]
        for line in logs
        if line["event"] in {"card_withdrawn", "worker_draining", "worker_stopped"}
    ]
    assert events == ["card_withdrawn", "worker_draining", "worker_stopped"]
    assert runtime.order == ["engine_shutdown"]
    assert logs.index(find(logs, "worker_stopped")[0]) < logs.index(find(logs, "engine_stopped")[0])
    assert not find(logs, "worker_drain_timeout")


async def test_an_engine_that_dies_makes_the_worker_withdraw_and_exit_1(
    logs: Logs, runtime: FakeRuntime
) -> None:
    serving = asyncio.create_task(process._serve_engine(config()))
    await until(lambda: find(logs, "worker_started"), "worker_started")
    runtime.dead.set()
    assert await asyncio.wait_for(serving, 30) == EXIT_FAILED
    assert find(logs, "engine_dead", reason="engine_core_dead")
    assert find(logs, "card_withdrawn")
    assert runtime.order == ["engine_shutdown"]


def test_the_card_carries_the_engine_s_figures(runtime: FakeRuntime) -> None:
    card = engine_card(config(), runtime, None)
    assert (card.kv_cache_block_size, card.context_length) == (32, 4096)
    figures = card.runtime_config
    assert (figures.total_kv_blocks, figures.max_num_seqs, figures.max_num_batched_tokens) == (640, 8, 2048)
