"""The request plane end to end: real ``dynamo-prep worker --engine mock`` processes and the client."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from support.images import png_data_url
from support.logs import until
from support.plane import tcp_endpoint
from support.request_plane import StartWorker, echo_workers, serving_catalog

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.engines.mock.engine import MockEngine
from dynamo_prep.frontend.client import RequestPlaneClient, WorkerError, WorkerLost
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.migration import Migration
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.openai import ChatCompletionRequest, parse_chat_request
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Cancel, Generate, Output
from dynamo_prep.routing.round_robin import RoundRobin

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
IMAGE = {"type": "image_url", "image_url": {"url": png_data_url()}}  # a real picture: workers decode it
LONG_TEXT = "Please describe every detail of this picture, slowly and carefully, one by one."


@pytest.fixture(scope="module")
def mock() -> MockEngine:
    """The same engine the sglang worker runs: the expected replies, computed locally."""
    return MockEngine(DEMO, flavor="sglang", reply_format="echo")


def chat(text: str = "Describe it.", **fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": [IMAGE, {"type": "text", "text": text}]}]
    return parse_chat_request({"model": DEMO, "messages": messages, **fields})


def preprocess(declared: str | None, text: str = "Describe it.", **fields: Any) -> PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(
        DEMO, runtime_config=ModelRuntimeConfig(image_placeholder_token=declared)
    )
    return OpenAIPreprocessor.new(card, DEMO).preprocess(chat(text, **fields))


def migration(
    client: RequestPlaneClient,
    instances: list[Instance],
    *,
    migration_limit: int,
    on_answered: Callable[[str], None] | None = None,
) -> tuple[Migration, LiveModel]:
    """A catalog serving the demo model on ``instances`` (the first is picked first), and its policy."""
    card = ModelDeploymentCard.from_model_dir(
        DEMO,
        migration_limit=migration_limit,
        runtime_config=ModelRuntimeConfig(image_placeholder_token=MEDIA_PAD),
    )
    catalog, model = serving_catalog(card, DEMO, instances)
    return Migration(
        catalog, RoundRobin(), client, DeclarationPreprocessors(), on_answered=on_answered
    ), model


def record() -> RequestRecord:
    return RequestRecord("r", "/v1/chat/completions", FrontendMetrics())


async def through(
    policy: Migration,
    model: LiveModel,
    request: ChatCompletionRequest,
    request_id: str,
    served_by: RequestRecord,
) -> AsyncIterator[Output]:
    """The outputs of one request through the migration policy (rendered, picked, streamed)."""
    journey = await policy.begin(model, request, request_id=request_id, record=served_by, timeout_s=30)
    async for output in policy.outputs(journey):
        yield output


@pytest.fixture
def workers() -> Iterator[StartWorker]:
    with echo_workers(DEMO) as start:
        yield start


@pytest.fixture
def routers() -> Iterator[Callable[[], zmq.Socket[Any]]]:
    """Bound ROUTERs driven by the test itself (silent, or answering what the test says)."""
    context = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []

    def bind() -> zmq.Socket[Any]:
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind("tcp://127.0.0.1:*")
        sockets.append(socket)
        return socket

    yield bind
    for socket in sockets:
        socket.close(linger=0)
    context.term()


@pytest.fixture
def silent(routers: Callable[[], zmq.Socket[Any]]) -> zmq.Socket[Any]:
    """A ROUTER that reads and never answers: a black-holed or forged announce's endpoint."""
    return routers()


async def next_generate(socket: zmq.Socket[Any]) -> tuple[bytes, Generate]:
    """The next Generate a hand-driven ROUTER receives (Pings answered on the way), with its peer."""
    while True:
        assert await asyncio.to_thread(socket.poll, 10_000), "no request within 10 s"
        identity, payload = socket.recv_multipart()
        message = wire.decode_to_worker(payload)
        if isinstance(message, Generate):
            return identity, message
        if isinstance(message, wire.Ping):
            socket.send_multipart([identity, wire.encode(wire.Pong(request_id=message.request_id))])


@pytest.fixture
async def client() -> AsyncIterator[RequestPlaneClient]:
    client = RequestPlaneClient(stall_timeout_s=1.0)
    yield client
    await client.close()


def text_of(mock: MockEngine, outputs: list[Output]) -> str:
    return mock.tokenizer.decode([t for o in outputs for t in o.token_ids])


async def test_streamed_generation_with_usage(
    workers: Any, client: RequestPlaneClient, mock: MockEngine
) -> None:
    proc, endpoint = workers("--token-delay", "0")
    request = preprocess(MEDIA_PAD)
    outputs = [o async for o in client.generate(endpoint, request, request_id="a1", timeout_s=5)]
    assert text_of(mock, outputs) == mock.reply_text(request)
    assert text_of(mock, outputs).startswith("[mock sglang] 1 image(s)")
    final = outputs[-1]
    assert final.finish_reason == "stop"
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert final.prompt_tokens == len(request.token_ids)
    assert final.completion_tokens == len(mock.tokenizer.encode(mock.reply_text(request)))
    declared = proc.wait_event("worker_declared_image_token")
    assert (declared["declared_token"], declared["source"]) == (MEDIA_PAD, "engine")


async def test_checkpoint_default_sent_to_sglang_is_a_400(workers: Any, client: RequestPlaneClient) -> None:
    _, endpoint = workers()
    with pytest.raises(WorkerError) as caught:
        async for _ in client.generate(endpoint, preprocess(None), request_id="bad", timeout_s=5):
            pass
    assert (caught.value.code, caught.value.message) == (
        400,
        "Expected 1 image placeholder token(s), found 0",
    )


async def test_consumer_stopping_early_cancels_on_the_worker(
    workers: Any, client: RequestPlaneClient
) -> None:
    proc, endpoint = workers("--token-delay", "0.2")
    stream = client.generate(endpoint, preprocess(MEDIA_PAD), request_id="c1", timeout_s=10)
    first = await anext(stream)
    assert first.token_ids
    await stream.aclose()
    finished = await asyncio.to_thread(proc.wait_event, "request_finished", request_id="c1")
    assert finished["finish_reason"] == "cancelled"


async def test_deadline_ends_the_stream(workers: Any, client: RequestPlaneClient) -> None:
    _, endpoint = workers("--token-delay", "0.2")
    outputs = [
        o async for o in client.generate(endpoint, preprocess(MEDIA_PAD), request_id="d1", timeout_s=0.5)
    ]
    assert outputs[-1].finish_reason == "deadline"
    assert 0 < outputs[-1].completion_tokens < 10


async def test_killed_worker_is_lost_by_stall_detection(workers: Any, client: RequestPlaneClient) -> None:
    proc, endpoint = workers("--token-delay", "0.2")
    stream = client.generate(endpoint, preprocess(MEDIA_PAD, LONG_TEXT), request_id="k1", timeout_s=30)
    await anext(stream)
    proc.kill()
    started = time.monotonic()
    with pytest.raises(WorkerLost) as caught:
        async for _ in stream:
            pass
    assert time.monotonic() - started < 15  # stall_timeout_s is 1 s, the request's deadline 30 s
    assert (caught.value.endpoint, caught.value.reason) == (endpoint, "stalled")


async def test_endpoint_lost_fails_in_flight_requests_at_once(
    workers: Any, client: RequestPlaneClient
) -> None:
    proc, endpoint = workers("--token-delay", "0.2")
    streams = [
        client.generate(endpoint, preprocess(MEDIA_PAD, LONG_TEXT), request_id=f"e{i}", timeout_s=30)
        for i in range(3)
    ]
    for stream in streams:
        await anext(stream)
    proc.kill()
    client.endpoint_lost(endpoint)
    for stream in streams:
        with pytest.raises(WorkerLost) as caught:
            await asyncio.wait_for(anext(stream), 0.5)
        assert caught.value.reason == "removed"


async def test_slow_but_alive_worker_answers_pings(workers: Any, client: RequestPlaneClient) -> None:
    _, endpoint = workers("--token-delay", "1.3")  # silent longer than the 1 s stall timeout
    request = preprocess(MEDIA_PAD, max_tokens=1)
    outputs = [o async for o in client.generate(endpoint, request, request_id="s1", timeout_s=10)]
    assert (outputs[-1].finish_reason, outputs[-1].completion_tokens) == ("length", 1)


async def test_migration_finishes_on_another_worker(
    workers: Any, client: RequestPlaneClient, mock: MockEngine
) -> None:
    first, first_endpoint = workers("--token-delay", "0.1")
    _, second_endpoint = workers("--token-delay", "0.02")
    a, b = (
        Instance(instance_id="a", endpoint=first_endpoint, declared_token=MEDIA_PAD),
        Instance(instance_id="b", endpoint=second_endpoint, declared_token=MEDIA_PAD),
    )
    policy, model = migration(client, [a, b], migration_limit=1)
    served = record()
    outputs: list[Output] = []
    stream = through(policy, model, chat(LONG_TEXT), "m1", served)
    async for output in stream:
        outputs.append(output)
        if len(outputs) == 5:
            first.kill()
    request = preprocess(MEDIA_PAD, LONG_TEXT)
    assert text_of(mock, outputs) == mock.reply_text(request)
    final = outputs[-1]
    assert final.finish_reason == "stop"
    assert final.prompt_tokens == len(request.token_ids)
    assert final.completion_tokens == sum(len(o.token_ids) for o in outputs)
    assert served.instance_id == "b"


async def test_migration_moves_to_another_declaration_with_a_prompt_rendered_for_it(
    workers: Any, client: RequestPlaneClient, mock: MockEngine
) -> None:
    """Mid-stream, an sglang worker dies; the vllm worker gets ITS contract plus the streamed tokens."""
    first, first_endpoint = workers("--token-delay", "0.1")
    second, second_endpoint = workers("--token-delay", "0", "--flavor", "vllm")
    sglang = Instance(instance_id="a", endpoint=first_endpoint, declared_token=MEDIA_PAD)
    vllm = Instance(instance_id="b", endpoint=second_endpoint, declared_token=None)
    policy, model = migration(client, [sglang, vllm], migration_limit=1)
    outputs: list[Output] = []
    async for output in through(policy, model, chat(LONG_TEXT), "x1", record()):
        outputs.append(output)
        if len(outputs) == 3:
            first.kill()
    streamed = text_of(mock, outputs[:3])
    text = text_of(mock, outputs)
    assert text.startswith(streamed) and "[mock vllm] 1 image(s)" in text  # no contract refusal
    assert outputs[-1].finish_reason == "stop"
    assert not second.find("mock_contract_violation")


async def test_migration_limit_zero_reraises(workers: Any, client: RequestPlaneClient) -> None:
    first, endpoint = workers("--token-delay", "0.2")
    _, other = workers("--token-delay", "0")
    a = Instance(instance_id="a", endpoint=endpoint, declared_token=MEDIA_PAD)
    b = Instance(instance_id="b", endpoint=other, declared_token=MEDIA_PAD)
    policy, model = migration(client, [a, b], migration_limit=0)
    stream = through(policy, model, chat(), "z1", record())
    await anext(stream)
    first.kill()
    client.endpoint_lost(endpoint)
    with pytest.raises(WorkerLost):
        await anext(stream)


async def test_sigterm_drains_in_flight_and_refuses_new_requests(
    workers: Any, client: RequestPlaneClient, mock: MockEngine
) -> None:
    proc, endpoint = workers("--token-delay", "0.05", "--drain-timeout", "10")
    request = preprocess(MEDIA_PAD)
    stream = client.generate(endpoint, request, request_id="t1", timeout_s=30)
    outputs = [await anext(stream)]
    proc.signal(signal.SIGTERM)
    await asyncio.to_thread(proc.wait_event, "worker_draining")
    assert proc.find("card_withdrawn"), "the card is withdrawn before the drain"
    with pytest.raises(WorkerError) as refused:
        async for _ in client.generate(endpoint, request, request_id="t2", timeout_s=5):
            pass
    assert refused.value.code == 503
    outputs += [o async for o in stream]
    assert text_of(mock, outputs) == mock.reply_text(request)
    assert outputs[-1].finish_reason == "stop"
    assert await asyncio.to_thread(proc.wait, 10) == 0


async def test_hundred_concurrent_requests_share_one_dealer(
    workers: Any, client: RequestPlaneClient, mock: MockEngine
) -> None:
    _, endpoint = workers("--token-delay", "0")
    requests = [preprocess(MEDIA_PAD, f"Question number {i}?") for i in range(100)]

    async def run(i: int) -> str:
        outputs = [o async for o in client.generate(endpoint, requests[i], request_id=f"n{i}", timeout_s=15)]
        assert outputs[-1].finish_reason == "stop"
        return text_of(mock, outputs)

    texts = await asyncio.gather(*(run(i) for i in range(100)))
    assert texts == [mock.reply_text(request) for request in requests]
    assert len(client._channels) == 1


async def test_an_instance_that_never_answers_is_failed_over_fast_and_then_avoided(
    workers: Any, client: RequestPlaneClient, silent: zmq.Socket[Any], mock: MockEngine
) -> None:
    """A forged or black-holed announce (here: a ROUTER that reads and never answers) costs one
    request the connect timeout, not the stall timeout, moves it for free (migration_limit 0), and
    later requests route around it."""
    _, endpoint = workers("--token-delay", "0")
    hole = Instance(instance_id="a", endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT))
    real = Instance(instance_id="b", endpoint=endpoint, declared_token=MEDIA_PAD)
    policy, model = migration(client, [hole, real], migration_limit=0)
    first = record()
    started = time.monotonic()
    outputs = [o async for o in through(policy, model, chat(), "h1", first)]
    assert outputs[-1].finish_reason == "stop" and first.instance_id == "b"
    assert time.monotonic() - started < 15  # moved after a timeout, not at the request's deadline
    assert hole.endpoint in client.unreachable_endpoints()
    received = len(_drain(silent))
    for index in range(3):
        again = record()
        [o async for o in through(policy, model, chat(), f"h{index + 2}", again)]
        assert again.instance_id == "b"
    assert len(_drain(silent)) == 0 and received >= 1  # never sent there again


async def test_a_model_is_reported_answered_by_its_first_output_never_by_a_silent_endpoint(
    client: RequestPlaneClient,
    silent: zmq.Socket[Any],
    routers: Callable[[], zmq.Socket[Any]],
) -> None:
    """What lets a scale-up of a model in use into a full discovery table (issue 13): the model of a
    worker that answered a request, reported once per request (at its first output, not again at
    later ones); a silent endpoint reports nothing. The worker is driven by the test, so the
    request has two outputs whatever the timing: the second is sent after the first was taken."""
    answered: list[str] = []
    hole = Instance(instance_id="a", endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT))
    policy, model = migration(client, [hole], migration_limit=0, on_answered=answered.append)
    with pytest.raises(WorkerLost):
        [o async for o in through(policy, model, chat(), "s1", record())]
    assert answered == []
    worker = routers()
    endpoint = worker.getsockopt_string(zmq.LAST_ENDPOINT)
    real = Instance(instance_id="b", endpoint=endpoint, declared_token=MEDIA_PAD)
    policy, model = migration(client, [hole, real], migration_limit=0, on_answered=answered.append)
    outputs = through(policy, model, chat(LONG_TEXT), "s2", record())
    first = asyncio.ensure_future(anext(outputs))
    identity, generate = await next_generate(worker)
    step = Output(request_id=generate.request_id, token_ids=[11], prompt_tokens=5, completion_tokens=1)
    worker.send_multipart([identity, wire.encode(step)])
    assert (await first).token_ids == [11]
    assert answered == [DEMO]
    final = Output(request_id=generate.request_id, token_ids=[12], finish_reason="stop", completion_tokens=2)
    worker.send_multipart([identity, wire.encode(final)])
    assert [o.token_ids async for o in outputs] == [[12]]
    assert answered == [DEMO]


async def test_answers_tells_a_live_worker_from_a_silent_endpoint(
    workers: Any, client: RequestPlaneClient, silent: zmq.Socket[Any]
) -> None:
    """The probe the discovery watcher uses for a newcomer a full table refused (issue 13)."""
    _, endpoint = workers("--token-delay", "0")
    assert await client.answers(endpoint, 5.0)
    started = time.monotonic()
    assert not await client.answers(silent.getsockopt_string(zmq.LAST_ENDPOINT), 0.3)
    assert time.monotonic() - started < 15  # its own 0.3 s bound, not a hang
    assert not await client.answers("tcp://127.0.0.1:9", 0.3)  # nothing listens there


def _drain(socket: zmq.Socket[Any]) -> list[list[bytes]]:
    frames = []
    while socket.poll(0):
        frames.append(socket.recv_multipart())
    return frames


async def test_a_worker_streaming_past_max_tokens_is_cut_there_and_cancelled(
    client: RequestPlaneClient,
) -> None:
    """A worker that ignores ``max_tokens`` (here: a hand-written ROUTER streaming 30 tokens, one
    frame of 10 at a time) is cut at the limit with ``length``, and told to stop."""
    context = zmq.asyncio.Context()
    rogue = context.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind("tcp://127.0.0.1:*")
    received: list[Any] = []

    async def serve() -> None:
        while True:
            identity, payload = await rogue.recv_multipart()
            message = wire.decode_to_worker(payload)
            received.append(message)
            if isinstance(message, Generate):
                for step in range(3):
                    output = Output(
                        request_id=message.request_id,
                        token_ids=list(range(10)),
                        completion_tokens=10 * (step + 1),
                    )
                    await rogue.send_multipart([identity, wire.encode(output)])

    server = asyncio.create_task(serve())
    try:
        instance = Instance(
            instance_id="rogue", endpoint=rogue.getsockopt_string(zmq.LAST_ENDPOINT), declared_token=MEDIA_PAD
        )
        policy, model = migration(client, [instance], migration_limit=0)
        outputs = [o async for o in through(policy, model, chat(max_tokens=5), "cut1", record())]
        assert sum(len(o.token_ids) for o in outputs) == 5
        assert (outputs[-1].finish_reason, outputs[-1].completion_tokens) == ("length", 5)
        deadline = time.monotonic() + 5
        while not any(isinstance(m, Cancel) for m in received):
            assert time.monotonic() < deadline, "the worker was never told to stop"
            await asyncio.sleep(0.01)
    finally:
        server.cancel()
        rogue.close(linger=0)
        context.term()


async def _fill(client: RequestPlaneClient, endpoint: str) -> tuple[int, asyncio.Task[None]]:
    """Queue a channel's high-water mark of Pings for an address nobody listens at (they go at once),
    then one more: (the mark, the send that waits for room)."""
    channel = client._channel(endpoint)
    hwm = channel.socket.getsockopt(zmq.SNDHWM)
    assert isinstance(hwm, int) and hwm > 0
    for n in range(hwm):
        await channel.send(wire.Ping(request_id=f"queued-{n}"))
    waiting = asyncio.create_task(channel.send(wire.Ping(request_id="waiting")))
    await until(lambda: channel._writable is not None, "the send past the high-water mark waits")
    assert not waiting.done()
    return hwm, waiting


async def test_a_send_waits_for_room_and_goes_out_once_a_worker_listens() -> None:
    """The channel's DEALER queues up to its high-water mark for a worker not there yet; the next
    send waits (no error, no busy loop) and goes out once the worker binds the address."""
    endpoint = tcp_endpoint()
    client = RequestPlaneClient(stall_timeout_s=60, idle_close_s=60, connect_timeout_s=60)
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        hwm, waiting = await _fill(client, endpoint)
        router.bind(endpoint)
        received = []
        while len(received) <= hwm:
            _, payload = await asyncio.wait_for(router.recv_multipart(), 10)
            received.append(wire.to_worker_decoder.decode(payload).request_id)
        await asyncio.wait_for(waiting, 10)
        assert received == [f"queued-{n}" for n in range(hwm)] + ["waiting"], "every message, in order"
    finally:
        router.close(linger=0)
        await client.close()


async def test_a_send_waiting_for_room_fails_as_lost_when_its_channel_closes() -> None:
    endpoint = tcp_endpoint()
    client = RequestPlaneClient(stall_timeout_s=60, idle_close_s=60, connect_timeout_s=60)
    try:
        _, waiting = await _fill(client, endpoint)
        client.endpoint_lost(endpoint)
        with pytest.raises(WorkerLost):
            await asyncio.wait_for(waiting, 10)
    finally:
        await client.close()
