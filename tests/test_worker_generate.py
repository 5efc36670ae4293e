"""Worker-side generation (in process): Generate / Cancel / Ping, deadlines, drain, mock continuation,
and ``dynamo_prep.worker.register`` for real engine processes.

The ``register`` tests use STAND-INS shaped like the real classes (``sglang_engine_standin``: an
object with SGLang's ``tokenizer_manager.mm_processor.mm_tokens`` path and values; ``None`` for
vLLM, which declares nothing), because real SGLang and vLLM engines need GPUs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from support.plane import SubCollector, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig, decode_card
from dynamo_prep.engines.mock.engine import MockContinuation, MockEngine, MockOutput
from dynamo_prep.engines.mock.standins import sglang_engine_standin
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.discovery import Announce, Withdraw
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Cancel, ErrorReply, Generate, Output, Ping, Pong
from dynamo_prep.worker.generate import GenerationServer
from dynamo_prep.worker.register import register

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def preprocess(declared: str | None, text: str = "Describe it.", **fields: Any) -> PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(
        DEMO, runtime_config=ModelRuntimeConfig(image_placeholder_token=declared)
    )
    messages = [{"role": "user", "content": [IMAGE, {"type": "text", "text": text}]}]
    return OpenAIPreprocessor.new(card, DEMO).preprocess({"model": DEMO, "messages": messages, **fields})


class Replies:
    """A ``reply`` coroutine that records what the worker sends, with an event per final message."""

    def __init__(self) -> None:
        self.sent: list[wire.FromWorker] = []
        self.final = asyncio.Event()

    async def __call__(self, message: wire.FromWorker) -> None:
        self.sent.append(message)
        if isinstance(message, ErrorReply) or (isinstance(message, Output) and message.finish_reason):
            self.final.set()

    async def wait_final(self) -> wire.FromWorker:
        await asyncio.wait_for(self.final.wait(), 5)
        return self.sent[-1]


def generate(request: PreprocessedRequest, request_id: str = "r1", timeout_s: float = 5.0) -> Generate:
    return Generate(request_id=request_id, request=request, deadline_ms=now_ms() + int(timeout_s * 1000))


@pytest.fixture(scope="module")
def engine() -> MockEngine:
    return MockEngine(DEMO, flavor="sglang", token_delay_s=0.05, reply_format="echo")


@pytest.fixture
def server(engine: MockEngine) -> GenerationServer:
    return GenerationServer(engine.generate, check=engine.check_contract)


async def test_streams_every_token_then_one_final(server: GenerationServer, engine: MockEngine) -> None:
    fast = MockEngine(DEMO, flavor="sglang", reply_format="echo")
    server = GenerationServer(fast.generate, check=fast.check_contract)
    request = preprocess(MEDIA_PAD)
    replies = Replies()
    await server.on_generate(generate(request), replies)
    final = await replies.wait_final()
    assert isinstance(final, Output) and final.finish_reason == "stop"
    outputs = [m for m in replies.sent if isinstance(m, Output)]
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    tokens = [t for o in outputs for t in o.token_ids]
    assert engine.tokenizer.decode(tokens) == engine.reply_text(request)
    assert (final.prompt_tokens, final.completion_tokens) == (len(request.token_ids), len(tokens))
    assert server.in_flight == 0


async def test_a_slower_stream_sends_every_step_as_it_comes(
    server: GenerationServer, engine: MockEngine
) -> None:
    request = preprocess(MEDIA_PAD, max_tokens=4)
    replies = Replies()
    await server.on_generate(generate(request), replies)
    await replies.wait_final()
    outputs = [m for m in replies.sent if isinstance(m, Output)]
    assert [o.token_ids for o in outputs] == [[t] for t in engine.reply_ids(request)[:4]]
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4]


async def test_contract_violation_is_400_before_any_task(server: GenerationServer) -> None:
    replies = Replies()
    await server.on_generate(generate(preprocess(None)), replies)
    assert replies.sent == [
        ErrorReply(request_id="r1", code=400, message="Expected 1 image placeholder token(s), found 0")
    ]
    assert server.in_flight == 0


async def test_deadline_passed_is_504_and_mid_stream_is_a_deadline_finish(server: GenerationServer) -> None:
    replies = Replies()
    await server.on_generate(generate(preprocess(MEDIA_PAD), timeout_s=-1), replies)
    [refused] = replies.sent
    assert isinstance(refused, ErrorReply) and refused.code == 504
    replies = Replies()
    await server.on_generate(generate(preprocess(MEDIA_PAD), timeout_s=0.2), replies)
    final = await replies.wait_final()
    assert isinstance(final, Output) and final.finish_reason == "deadline"
    assert 0 < final.completion_tokens < 27
    assert final.completion_tokens == sum(len(m.token_ids) for m in replies.sent if isinstance(m, Output))


async def test_cancel_ends_with_cancelled_and_unknown_ids_are_ignored(server: GenerationServer) -> None:
    replies = Replies()
    await server.on_generate(generate(preprocess(MEDIA_PAD)), replies)
    await server.on_cancel(Cancel(request_id="unknown"), replies)
    await server.on_cancel(Cancel(request_id="r1"), replies)
    final = await replies.wait_final()
    assert isinstance(final, Output) and final.finish_reason == "cancelled"
    assert server.in_flight == 0


async def test_duplicate_request_id_is_refused(server: GenerationServer) -> None:
    first, second = Replies(), Replies()
    await server.on_generate(generate(preprocess(MEDIA_PAD)), first)
    await server.on_generate(generate(preprocess(MEDIA_PAD)), second)
    assert second.sent == [ErrorReply(request_id="r1", code=400, message="duplicate request_id")]
    await server.on_cancel(Cancel(request_id="r1"), first)
    await first.wait_final()


async def test_ping_pong(server: GenerationServer) -> None:
    replies = Replies()
    await server.on_ping(Ping(request_id="p7"), replies)
    assert replies.sent == [Pong(request_id="p7")]


async def test_drain_refuses_new_work_and_cancels_leftovers_with_503(server: GenerationServer) -> None:
    replies = Replies()
    await server.on_generate(generate(preprocess(MEDIA_PAD)), replies)
    cancelled = await server.drain(timeout_s=0.1)
    assert cancelled == 1
    final = await replies.wait_final()
    assert isinstance(final, ErrorReply) and final.code == 503
    late = Replies()
    await server.on_generate(generate(preprocess(MEDIA_PAD), request_id="r2"), late)
    assert late.sent == [ErrorReply(request_id="r2", code=503, message="worker is draining")]


async def test_mock_continues_a_migrated_request(engine: MockEngine) -> None:
    continuing = MockContinuation(MockEngine(DEMO, flavor="sglang", reply_format="echo"))
    request = preprocess(MEDIA_PAD)
    full = engine.tokenizer.encode(engine.reply_text(request))
    assert continuing.already_streamed(request) == 0
    for streamed in (1, 5, len(full) - 1):
        migrated = _extended(request, full[:streamed])
        assert continuing.already_streamed(migrated) == streamed
        rest = [step async for step in continuing.generate(migrated)]
        assert [t for step in rest for t in step.token_ids] == full[streamed:]
        assert rest[-1].finish_reason == "stop"
        assert rest[-1].completion_tokens == len(full) - streamed


def _extended(request: PreprocessedRequest, streamed: list[int]) -> PreprocessedRequest:
    import msgspec  # noqa: PLC0415

    stop = msgspec.structs.replace(
        request.stop_conditions, max_tokens=request.stop_conditions.max_tokens - len(streamed)
    )
    return msgspec.structs.replace(request, token_ids=[*request.token_ids, *streamed], stop_conditions=stop)


# --- register(): what a real SGLang / vLLM worker process calls --------------------------------


@pytest.fixture
def plane() -> Iterator[tuple[str, SubCollector]]:
    address = tcp_endpoint()
    with SubCollector(address, bind=True) as collector:
        yield address, collector


async def _announced(collector: SubCollector) -> Announce:
    message = (await asyncio.to_thread(collector.wait_messages, lambda m: isinstance(m, Announce)))[0]
    assert isinstance(message, Announce)
    return message


async def test_register_sglang_declares_its_processor_token_and_serves(
    plane: tuple[str, SubCollector],
) -> None:
    """SGLang stand-in (real SGLang needs a GPU): the card declares ``<|media_pad|>``; Generate works."""
    address, collector = plane
    fast = MockEngine(DEMO, flavor="sglang", reply_format="echo")

    def stream(request: PreprocessedRequest) -> AsyncIterator[MockOutput]:
        return fast.generate(request)

    worker = await register(
        sglang_engine_standin(DEMO), flavor="sglang", model_path=DEMO, discovery=[address], generate=stream
    )
    client = RequestPlaneClient()
    try:
        announce = await _announced(collector)
        assert decode_card(announce.card).card.runtime_config.image_placeholder_token == MEDIA_PAD
        assert announce.endpoint == worker.endpoint
        request = preprocess(MEDIA_PAD)
        outputs = [o async for o in client.generate(worker.endpoint, request, request_id="x", timeout_s=5)]
        assert fast.tokenizer.decode([t for o in outputs for t in o.token_ids]) == fast.reply_text(request)
    finally:
        await client.close()
        await worker.stop()
    withdraw = await asyncio.to_thread(collector.wait_messages, lambda m: isinstance(m, Withdraw))
    assert withdraw[0].instance_id == worker.instance_id


async def test_register_vllm_declares_nothing(plane: tuple[str, SubCollector]) -> None:
    """vLLM: ``None`` stands in for the engine (real vLLM needs a GPU); vLLM never declares a token."""
    address, collector = plane
    worker = await register(None, flavor="vllm", model_path=DEMO, discovery=[address])
    try:
        announce = await _announced(collector)
        assert decode_card(announce.card).card.runtime_config.image_placeholder_token is None
    finally:
        await worker.stop()
