"""Several tokens in one step: Outputs merged by the client, multi-token frames through migration,
answers and metrics. The workers here are hand-driven ROUTER sockets on loopback (real ZeroMQ),
so the test decides exactly which frames arrive, and when."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from support.plane import SubCollector, start_dynamo, tcp_endpoint
from support.request_plane import serving_catalog

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.frontend.client import RequestPlaneClient, WorkerError
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.metrics import FrontendMetrics, observe_many
from dynamo_prep.frontend.migration import Migration
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.openai import parse_chat_request
from dynamo_prep.protocol.wire import ErrorReply, Generate, Output, merged
from dynamo_prep.routing.round_robin import RoundRobin

DEMO = "kimi-k3-demo"
MAX_TOKENS = 10


class HandWorker:
    """A ROUTER the test drives: ``request()`` waits for a Generate, ``send`` answers it."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.peer = b""

    async def request(self) -> Generate:
        while True:
            self.peer, payload = await self.socket.recv_multipart()
            message = wire.decode_to_worker(payload)
            if isinstance(message, Generate):
                return message

    async def send(self, *messages: wire.FromWorker) -> None:
        for message in messages:
            await self.socket.send_multipart([self.peer, wire.encode(message)])


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def output(request_id: str, tokens: list[int], done: int, finish: str | None = None) -> Output:
    return Output(
        request_id=request_id, token_ids=tokens, finish_reason=finish, prompt_tokens=7, completion_tokens=done
    )


def test_merged_keeps_every_token_and_the_last_usage() -> None:
    parts = [output("r", [1], 1), output("r", [], 1), output("r", [2, 3], 3), output("r", [4], 4, "stop")]
    one = merged(parts)
    assert one.token_ids == [1, 2, 3, 4]
    assert (one.finish_reason, one.prompt_tokens, one.completion_tokens) == ("stop", 7, 4)
    assert merged(parts[:1]) is parts[0]


async def test_replies_waiting_together_reach_the_consumer_as_one_output(
    context: zmq.asyncio.Context,
) -> None:
    worker = HandWorker(context)
    client = RequestPlaneClient(context)
    try:
        stream = client.generate(worker.endpoint, preprocessed(), request_id="burst", timeout_s=10)
        pending, _ = await started(stream, worker)
        await worker.send(output("burst", [5], 1))
        assert (await pending).token_ids == [5]
        # Four steps at once (and an error reply of another request in between): one Output.
        await worker.send(
            output("burst", [6], 2),
            output("burst", [7, 8], 4),
            ErrorReply(request_id="someone-else", code=503, message="x"),
            output("burst", [9], 5),
            output("burst", [10], 6, "length"),
        )
        rest = [item async for item in stream]
        assert [token for item in rest for token in item.token_ids] == [6, 7, 8, 9, 10]
        assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 6
    finally:
        await client.close()


async def test_tokens_before_a_failure_are_yielded_then_it_is_raised(context: zmq.asyncio.Context) -> None:
    worker = HandWorker(context)
    client = RequestPlaneClient(context)
    try:
        stream = client.generate(worker.endpoint, preprocessed(), request_id="f", timeout_s=10)
        pending, _ = await started(stream, worker)
        await worker.send(output("f", [1], 1), output("f", [2, 3], 3))
        await worker.send(ErrorReply(request_id="f", code=503, message="draining"))
        tokens: list[int] = []
        with pytest.raises(WorkerError, match="503 draining"):
            tokens += (await pending).token_ids
            async for item in stream:
                tokens += item.token_ids
        assert tokens == [1, 2, 3]
    finally:
        await client.close()


async def test_a_multi_token_frame_migrates_with_every_token_and_counts_each(
    context: zmq.asyncio.Context,
) -> None:
    """A worker that sent three tokens in one frame is lost: the next one continues after all three
    (prompt extended, max_tokens reduced), usage stays the client's, inter-token latency counts
    every token."""
    lost, next_one = HandWorker(context), HandWorker(context)
    client = RequestPlaneClient(context)
    metrics = FrontendMetrics()
    record = RequestRecord("m", "/v1/chat/completions", metrics)
    policy, model = migration(client, [lost, next_one])
    record.serving(DEMO)
    chat = parse_chat_request(chat_body())
    journey = await policy.begin(model, chat, request_id="m", record=record, timeout_s=10)
    stream = policy.outputs(journey)
    try:
        pending, sent = await started(stream, lost)
        await lost.send(output("m", [11], 1))
        record.output(await pending)
        await lost.send(output("m", [12, 13, 14], 4))
        burst = await anext(stream)
        record.output(burst)
        assert burst.token_ids == [12, 13, 14]
        client.endpoint_lost(lost.endpoint)  # its instance expired
        pending, continued = await started(stream, next_one)
        assert continued.request.token_ids == [*sent.request.token_ids, 11, 12, 13, 14]
        assert continued.request.stop_conditions.max_tokens == MAX_TOKENS - 4
        await next_one.send(output("m", [15, 16], 2, "stop"))
        final = await pending
        record.output(final)
        assert final.token_ids == [15, 16]
        assert (final.prompt_tokens, final.completion_tokens) == (len(sent.request.token_ids), 6)
        assert journey.streamed == [11, 12, 13, 14, 15, 16]
    finally:
        await stream.aclose()
        await client.close()
    itl = metrics.registry.get_sample_value(
        "dynamo_frontend_inter_token_latency_seconds_count", {"model": DEMO}
    )
    assert itl == 5  # every token after the first, whatever frame it came in


# -- helpers ----------------------------------------------------------------------------------------


def chat_body() -> dict[str, object]:
    return {"model": DEMO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS}


def preprocessed() -> wire.PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(DEMO)
    return OpenAIPreprocessor.new(card, DEMO).preprocess(chat_body())


def migration(client: RequestPlaneClient, workers: list[HandWorker]) -> tuple[Migration, LiveModel]:
    card = ModelDeploymentCard.from_model_dir(DEMO, migration_limit=1)
    instances = [Instance(instance_id=f"w{i}", endpoint=w.endpoint) for i, w in enumerate(workers)]
    catalog, model = serving_catalog(card, DEMO, instances)
    return Migration(catalog, RoundRobin(), client, DeclarationPreprocessors()), model


async def started(stream: AsyncIterator[Output], worker: HandWorker) -> tuple[asyncio.Task[Output], Generate]:
    """The stream's next Output in the making, and the Generate it sent ``worker``."""
    pending = asyncio.ensure_future(anext(stream))
    return pending, await worker.request()


def test_observe_many_equals_as_many_observations() -> None:
    def exposition(observe: Callable[[Histogram, float, int], None]) -> list[str]:
        registry = CollectorRegistry()
        histogram = Histogram("itl", "x", ["m"], buckets=(0.001, 0.01, 0.1), registry=registry).labels(m="a")
        for value, count in [(0.0005, 3), (0.005, 1), (0.05, 7), (5.0, 2), (0.01, 4), (0.02, 0)]:
            observe(histogram, value, count)
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    def one_by_one(histogram: Histogram, value: float, count: int) -> None:
        for _ in range(count):
            histogram.observe(value)

    assert exposition(observe_many) == exposition(one_by_one)


async def test_cancels_sent_between_replies_never_hide_replies_from_the_receiver(
    tmp_path: Path,
) -> None:
    """A Cancel goes out on the synchronous shadow socket, and any call on a ZeroMQ socket may
    consume the edge of replies that just arrived: the client must still see them (a receive loop
    that missed them would leave every request on the channel silent until it is declared lost)."""
    discovery = tcp_endpoint()
    with SubCollector(discovery, bind=True):
        worker = start_dynamo(
            "worker",
            "--model-path",
            DEMO,
            "--discovery",
            discovery,
            "--token-delay",
            "0.002",
            log_level="info",
        )
        client = RequestPlaneClient(stall_timeout_s=1.0)
        try:
            endpoint = worker.wait_event("worker_started")["endpoint"]
            request = preprocessed()

            async def first_then_leave(index: int) -> None:
                stream = client.generate(endpoint, request, request_id=f"c{index}", timeout_s=10)
                async with contextlib.aclosing(stream):
                    await anext(stream)  # then Cancel, sent while other replies arrive

            for start in range(0, 600, 20):
                await asyncio.gather(*(first_then_leave(start + i) for i in range(20)))
            outputs = [
                item async for item in client.generate(endpoint, request, request_id="last", timeout_s=10)
            ]
            assert outputs[-1].finish_reason is not None
        finally:
            await client.close()
            worker.stop()
