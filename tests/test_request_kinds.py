"""Non-streamed request kinds on the request plane (issue 29 point 6): a kind is one ``Unary``
struct, one handler on the worker and one ``RequestPlaneClient.call``. Shown with ``Echo`` through
real ``dynamo-prep worker`` processes (mock engine) over real ZeroMQ; what a broken worker may
answer, against a hand-driven ROUTER; the worker's ``CallServer`` refusals, cancel and drain in
process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import msgspec
import pytest
import zmq
from support.plane import SubCollector, start_dynamo, tcp_endpoint

from dynamo_prep.frontend.client import RequestPlaneClient, WorkerError
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.calls import Echo, Echoed
from dynamo_prep.protocol.clock import now_ms
from dynamo_prep.protocol.preprocessed import PreprocessedRequest, StopConditions
from dynamo_prep.protocol.wire import Answer, Call, Cancel, ErrorReply, Output, Unary
from dynamo_prep.worker.calls import CallError, CallServer, echo

DEMO = "kimi-k3-demo"


class Unserved(Unary[Echoed], kw_only=True):
    """A kind written in a test, which no worker serves: nothing on the wire had to change for it."""

    method: ClassVar[str] = "not_served_anywhere"
    answer: ClassVar[type[Any]] = Echoed
    data: bytes


@pytest.fixture
def worker() -> Iterator[str]:
    """One mock worker process; its request-plane endpoint."""
    plane = tcp_endpoint()
    with SubCollector(plane, bind=True):
        proc = start_dynamo(
            "worker", "--model-path", DEMO, "--reply-format", "echo", "--token-delay", "0.01",
            "--discovery", plane,
        )  # fmt: skip
        try:
            yield proc.wait_event("worker_started")["endpoint"]
        finally:
            proc.stop()


@pytest.fixture
def metrics() -> FrontendMetrics:
    return FrontendMetrics()


@pytest.fixture
async def client(metrics: FrontendMetrics) -> AsyncIterator[RequestPlaneClient]:
    client = RequestPlaneClient(stall_timeout_s=5.0, metrics=metrics)
    yield client
    await client.close()


def refused(metrics: FrontendMetrics, reason: str) -> float:
    name = "dynamo_frontend_worker_replies_refused_total"
    return metrics.registry.get_sample_value(name, {"reason": reason}) or 0.0


async def test_a_call_is_answered_by_a_mock_worker(worker: str, client: RequestPlaneClient) -> None:
    answer = await client.call(worker, Echo(data=b"\x00 bytes"), request_id="c1", timeout_s=10)
    assert answer == Echoed(data=b"\x00 bytes")


async def test_calls_interleave_with_a_stream_on_one_channel(worker: str, client: RequestPlaneClient) -> None:
    """Calls made while a generation streams on the same DEALER are each answered; the stream ends."""
    request = PreprocessedRequest(
        model=DEMO, token_ids=[3000, 3001, 3002], stop_conditions=StopConditions(max_tokens=32)
    )

    async def stream() -> list[Output]:
        return [o async for o in client.generate(worker, request, request_id="g1", timeout_s=30)]

    streaming = asyncio.create_task(stream())
    calls = (client.call(worker, Echo(data=bytes([n])), request_id=f"c{n}", timeout_s=10) for n in range(20))
    assert await asyncio.gather(*calls) == [Echoed(data=bytes([n])) for n in range(20)]
    assert (await streaming)[-1].finish_reason is not None
    assert client.endpoints == [worker]  # one channel carried both


async def test_a_kind_the_worker_does_not_serve_is_a_400(worker: str, client: RequestPlaneClient) -> None:
    with pytest.raises(WorkerError) as raised:
        await client.call(worker, Unserved(data=b"x"), request_id="u1", timeout_s=10)
    assert (raised.value.code, raised.value.message) == (400, "unsupported request")
    assert await client.call(worker, Echo(data=b"y"), request_id="u2", timeout_s=10) == Echoed(data=b"y")


@pytest.fixture
def router() -> Iterator[zmq.Socket[Any]]:
    """A ROUTER the test drives by hand, answering as a broken worker would."""
    context: zmq.Context[Any] = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind("tcp://127.0.0.1:*")
    yield socket
    socket.close(linger=0)
    context.term()


async def next_of(socket: zmq.Socket[Any], kind: type[Any]) -> tuple[bytes, Any]:
    """The next message of ``kind`` the hand-driven ROUTER receives (Pings answered on the way)."""
    while True:
        assert await asyncio.to_thread(socket.poll, 10_000), "no request within 10 s"
        identity, payload = socket.recv_multipart()
        message = wire.decode_to_worker(payload)
        if isinstance(message, kind):
            return identity, message
        if isinstance(message, wire.Ping):
            socket.send_multipart([identity, wire.encode(wire.Pong(request_id=message.request_id))])


def answer(call: Call, value: Any) -> bytes:
    return wire.encode(Answer(request_id=call.request_id, body=wire.encode_body(value)))


async def test_an_answer_of_the_wrong_shape_is_an_error_not_a_crash(
    router: zmq.Socket[Any], client: RequestPlaneClient, metrics: FrontendMetrics
) -> None:
    """An Output sent to a call is unsolicited; an answer that is not the kind's answer fails the
    call with a 500 (a 502 to an HTTP client) and is counted as refused."""
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    calling = asyncio.create_task(client.call(endpoint, Echo(data=b"z"), request_id="h1", timeout_s=10))
    identity, call = await next_of(router, Call)
    assert (call.method, wire.decode_body(call.body, Echo)) == ("echo", Echo(data=b"z"))
    output = wire.encode(Output(request_id="h1", token_ids=[1]))
    router.send_multipart([identity, output, answer(call, {"data": 7})])
    with pytest.raises(WorkerError) as raised:
        await calling
    assert raised.value.code == 500
    assert "not a Echoed" in raised.value.message
    assert (refused(metrics, "unsolicited"), refused(metrics, "invalid")) == (1, 1)


async def test_a_call_its_caller_left_is_cancelled_and_its_late_answer_dropped(
    router: zmq.Socket[Any], client: RequestPlaneClient, metrics: FrontendMetrics
) -> None:
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    calling = asyncio.create_task(client.call(endpoint, Echo(data=b"a"), request_id="l1", timeout_s=10))
    identity, left = await next_of(router, Call)
    calling.cancel()
    _, cancel = await next_of(router, Cancel)
    assert cancel.request_id == left.request_id
    router.send_multipart([identity, answer(left, Echoed(data=b"a"))])  # late: dropped uncounted
    calling = asyncio.create_task(client.call(endpoint, Echo(data=b"b"), request_id="l2", timeout_s=10))
    identity, call = await next_of(router, Call)
    router.send_multipart([identity, answer(call, Echoed(data=b"b"))])
    assert await calling == Echoed(data=b"b")  # after the late answer on the same socket
    assert refused(metrics, "unsolicited") == 0


class Replies:
    """A worker-side ``reply`` that records what it is sent."""

    def __init__(self) -> None:
        self.sent: list[wire.FromWorker] = []
        self.arrived = asyncio.Event()

    async def __call__(self, message: wire.FromWorker) -> None:
        self.sent.append(message)
        self.arrived.set()

    async def next(self) -> wire.FromWorker:
        await asyncio.wait_for(self.arrived.wait(), 10)
        self.arrived.clear()
        return self.sent[-1]


def call_of(
    request: Unary[Any], request_id: str = "w1", *, timeout_s: float = 10.0, method: str = ""
) -> Call:
    deadline_ms = now_ms() + int(timeout_s * 1000)
    body = wire.encode_body(request)
    return Call(request_id=request_id, method=method or request.method, body=body, deadline_ms=deadline_ms)


def error(reply: wire.FromWorker) -> tuple[int, str]:
    assert isinstance(reply, ErrorReply), reply
    return reply.code, reply.message


async def test_the_worker_refuses_what_it_cannot_start() -> None:
    server, replies = CallServer(), Replies()
    server.register(Echo, echo)
    await server.on_call(call_of(Unserved(data=b"x")), replies)
    assert error(await replies.next()) == (400, "unsupported request")
    await server.on_call(call_of(Echo(data=b"x"), timeout_s=-1), replies)
    assert error(await replies.next()) == (504, "deadline passed before the request started")
    await server.on_call(
        call_of(Unserved(data=b"x"), method="echo"), replies
    )  # its body is an Echo: served as one
    assert await replies.next() == Answer(request_id="w1", body=wire.encode_body(Echoed(data=b"x")))
    bad = Call(request_id="w2", method="echo", body=msgspec.Raw(b"\xc1"), deadline_ms=now_ms() + 10_000)
    await server.on_call(bad, replies)
    assert error(await replies.next()) == (400, "invalid request")


async def test_a_handler_refuses_fails_or_runs_past_its_deadline() -> None:
    server, replies = CallServer(), Replies()

    async def refusing(request: Echo) -> Echoed:
        raise CallError(422, f"no {request.data!r}")

    async def failing(request: Echo) -> Echoed:
        raise KeyError(request.data)

    async def hanging(request: Echo) -> Echoed:
        await asyncio.Event().wait()
        return Echoed(data=request.data)

    for handler, expected in ((refusing, (422, "no b'x'")), (failing, (500, "KeyError"))):
        server.register(Echo, handler)
        await server.on_call(call_of(Echo(data=b"x")), replies)
        assert error(await replies.next()) == expected
    server.register(Echo, hanging)
    await server.on_call(call_of(Echo(data=b"x"), timeout_s=0.2), replies)
    assert error(await replies.next()) == (504, "deadline passed")


async def test_a_cancel_stops_a_call_and_a_drain_answers_the_rest_with_503() -> None:
    server, replies = CallServer(), Replies()
    started = asyncio.Event()

    async def hanging(request: Echo) -> Echoed:
        started.set()
        await asyncio.Event().wait()
        return Echoed(data=request.data)

    server.register(Echo, hanging)
    passed: list[Cancel] = []

    async def generation_cancel(message: Cancel, _reply: Any) -> None:
        passed.append(message)

    on_cancel = server.cancelling(generation_cancel)
    await server.on_call(call_of(Echo(data=b"x"), "c1"), replies)
    await asyncio.wait_for(started.wait(), 10)
    await on_cancel(Cancel(request_id="c1"), replies)
    await on_cancel(Cancel(request_id="a-stream"), replies)  # not a call: the generation server's
    assert [message.request_id for message in passed] == ["a-stream"]
    await server.on_call(call_of(Echo(data=b"y"), "c2"), replies)
    await server.drain(0.0)
    assert replies.sent == [
        ErrorReply(request_id="c2", code=503, message="worker stopped before the request finished")
    ]
    assert server.in_flight == 0
    await server.on_call(call_of(Echo(data=b"z"), "c3"), replies)
    assert error(await replies.next()) == (503, "worker is draining")
