"""Hostile worker replies (issue 20, rows 10, 13, 14, 15, 18): a raw-pyzmq worker speaking the
request-plane wire (``support/fake_worker.py``) against the real ``RequestPlaneClient`` and
migration policy, and once behind a real ``dynamo-prep frontend``.

Each test asserts what the frontend does (statuses, counters, log lines, the size of what it kept),
never how long it took; each fails on the old code (noted per test).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from support.fake_worker import FakeWorker, Frames
from support.logs import Logs, find, until
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.catalog import LiveModel, ModelCatalog
from dynamo_prep.frontend.client import (
    FLOOD_BURST,
    MAX_BUFFERED_TOKENS,
    MAX_WORKER_MESSAGE_CHARS,
    RequestPlaneClient,
    SlowReader,
    WorkerError,
)
from dynamo_prep.frontend.declarations import DeclarationPreprocessors
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.frontend.migration import Migration
from dynamo_prep.frontend.request_record import RequestRecord
from dynamo_prep.logging import DETAIL_CHARS
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.openai import parse_chat_request
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.protocol.wire import Output
from dynamo_prep.routing.round_robin import RoundRobin

K3 = "kimi-k3-demo"
TOKEN = 3_000  # an ordinary id of the demo vocabulary
ANSWER = [TOKEN, TOKEN + 1, TOKEN + 2]


def output(request_id: str, tokens: list[int], finish: str | None = None, **usage: int) -> bytes:
    return wire.encode(Output(request_id=request_id, token_ids=tokens, finish_reason=finish, **usage))


def honest(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Three tokens and the end, with true usage."""
    del worker
    prompt = len(request.request.token_ids)
    yield output(request.request_id, ANSWER, "stop", prompt_tokens=prompt, completion_tokens=len(ANSWER))


def flooding(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Replies for request ids nobody asked for, never one for the request."""
    del worker, request
    return (output(f"flood-{index}", []) for index in range(20 * FLOOD_BURST))


def ponging(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Pongs nobody asked for (each would count as a sign of life), never a reply."""
    del worker, request
    return (wire.encode(wire.Pong(request_id=f"p{index}")) for index in range(20 * FLOOD_BURST))


def garbage(worker: FakeWorker, request: wire.Generate) -> Frames:
    del worker, request
    return (b"\xc1 not msgpack" for _ in range(5_000))


def endless(worker: FakeWorker, request: wire.Generate) -> Frames:
    """100 tokens a frame until told to stop (bounded: 2,000 frames)."""
    for index in range(2_000):
        if index % 8 == 0 and worker.of_kind(wire.Cancel):
            return
        yield output(request.request_id, [TOKEN] * 100, completion_tokens=100 * (index + 1))


@pytest.fixture
def fakes() -> Iterator[Any]:
    made: list[FakeWorker] = []

    def make(behaviour: Any = honest) -> FakeWorker:
        worker = FakeWorker(K3, behaviour)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


@pytest.fixture
def metrics() -> FrontendMetrics:
    return FrontendMetrics()


@pytest.fixture
async def client(logs: Logs, metrics: FrontendMetrics) -> AsyncIterator[RequestPlaneClient]:
    del logs  # bound before the client is built
    made = RequestPlaneClient(stall_timeout_s=30.0, first_token_timeout_s=30.0, metrics=metrics)
    yield made
    await made.close()


def policy(
    client: RequestPlaneClient, workers: list[FakeWorker], *, moves: int = 1
) -> tuple[Migration, LiveModel]:
    """The demo model served by ``workers`` (the first is picked first), ``moves`` moves allowed."""
    card = ModelDeploymentCard.from_model_dir(K3, migration_limit=moves)
    instances = {
        f"w{index}": Instance(instance_id=f"w{index}", endpoint=w.endpoint) for index, w in enumerate(workers)
    }
    model = LiveModel(
        K3, card, card.mdcsum(), OpenAIPreprocessor.new(card, K3), instances, model_dir=resolve_model_dir(K3)
    )
    catalog = ModelCatalog()
    catalog.publish(model)
    return Migration(catalog, RoundRobin(), client, DeclarationPreprocessors()), model


async def served(
    client: RequestPlaneClient,
    workers: list[FakeWorker],
    metrics: FrontendMetrics,
    moves: int = 1,
    **fields: Any,
) -> list[Output]:
    """One chat's outputs through the migration policy."""
    migration, model = policy(client, workers, moves=moves)
    chat = parse_chat_request({"model": K3, "messages": [{"role": "user", "content": "hi"}], **fields})
    record = RequestRecord("r", "/v1/chat/completions", metrics)
    journey = await migration.begin(model, chat, request_id="req-1", record=record, timeout_s=60)
    return [item async for item in migration.outputs(journey)]


def refused(metrics: FrontendMetrics, reason: str) -> float:
    return (
        metrics.registry.get_sample_value("dynamo_frontend_worker_replies_refused_total", {"reason": reason})
        or 0.0
    )


def faults(metrics: FrontendMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("dynamo_frontend_worker_faults_total", {"reason": reason}) or 0.0


def request_for(max_tokens: int) -> PreprocessedRequest:
    card = ModelDeploymentCard.from_model_dir(K3)
    chat = parse_chat_request({"model": K3, "messages": [{"role": "user", "content": "hi"}]})
    request = OpenAIPreprocessor.new(card, K3).preprocess(chat)
    stop = msgspec.structs.replace(request.stop_conditions, max_tokens=max_tokens)
    return msgspec.structs.replace(request, stop_conditions=stop)


def tokens(outputs: list[Output]) -> list[int]:
    return [token for item in outputs for token in item.token_ids]


# -- row 10: a flooding worker -----------------------------------------------------------------


@pytest.mark.parametrize("behaviour", [flooding, ponging])
async def test_a_flooding_worker_is_dropped_logged_once_and_its_request_moves(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics, logs: Logs, behaviour: Any
) -> None:
    """Old code: the flood kept the channel 'alive' and the request waited for its deadline."""
    flood, good = fakes(behaviour), fakes()
    outputs = await served(client, [flood, good], metrics)
    assert tokens(outputs) == ANSWER
    dropped = find(logs, "worker_dropped", reason="flooding")
    assert len(dropped) == 1 and dropped[0]["endpoint"] == flood.endpoint
    assert faults(metrics, "flooding") == 1
    if behaviour is flooding:
        assert refused(metrics, "unsolicited") > FLOOD_BURST  # every one counted, none logged alone
    assert find(logs, "request_migrated") and flood.endpoint in client.unreachable_endpoints()


async def test_replies_in_flight_after_a_cancel_do_not_count_against_the_worker(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics, logs: Logs
) -> None:
    """A fast honest worker has many frames in flight when its client leaves: more than the
    flood allowance arrive after the Cancel, and the worker is not taken for a flooder."""
    late = FLOOD_BURST + 5_000

    def fast(worker: FakeWorker, request: wire.Generate) -> Frames:
        if request.request_id != "gone":
            return honest(worker, request)
        frames = (output("gone", [TOKEN], completion_tokens=index + 1) for index in range(late))
        return iter([*frames, output("gone", [], "cancelled", completion_tokens=late)])

    worker = fakes(fast)
    steps = client.generate(worker.endpoint, request_for(1_000_000), request_id="gone", timeout_s=60)
    await anext(steps)
    await steps.aclose()  # the client left: Cancel sent, the rest of the stream is late
    await until(lambda: worker.sent > late, "the whole stream sent")
    answer = [
        o async for o in client.generate(worker.endpoint, request_for(10), request_id="next", timeout_s=60)
    ]
    assert tokens(answer) == ANSWER  # after every late frame on the same connection
    assert refused(metrics, "unsolicited") == 0 and not find(logs, "worker_dropped")


# -- row 15: garbage -------------------------------------------------------------------------


async def test_garbage_is_counted_logged_at_most_once_a_second_and_then_dropped(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics, logs: Logs
) -> None:
    """Old code: one warning line per frame (and a second decode of each); never dropped."""
    junk, good = fakes(garbage), fakes()
    outputs = await served(client, [junk, good], metrics)
    assert tokens(outputs) == ANSWER
    counted = refused(metrics, "undecodable")
    lines = find(logs, "reply_rejected")
    assert counted > 100 and 1 <= len(lines) <= 3, (counted, len(lines))  # the drop comes within a second
    assert lines[0]["reason"] == "undecodable" and len(lines[0]["error"]) <= DETAIL_CHARS
    assert [line["reason"] for line in find(logs, "worker_dropped")] == ["garbage"]
    assert faults(metrics, "garbage") == 1


# -- row 13: max_tokens, usage, messages, frames -------------------------------------------------


async def test_a_stream_is_cut_at_max_tokens_as_it_arrives_even_unread(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics
) -> None:
    """Old code: the cut happened only when the consumer read, so an unread stream never stopped."""
    worker = fakes(endless)
    steps = client.generate(worker.endpoint, request_for(250), request_id="cut", timeout_s=60)
    outputs = [await anext(steps)]
    await until(lambda: worker.of_kind(wire.Cancel), "the worker told to stop")  # nobody read meanwhile
    outputs += [item async for item in steps]
    assert len(tokens(outputs)) == 250
    assert (outputs[-1].finish_reason, outputs[-1].completion_tokens) == ("length", 250)
    assert refused(metrics, "past_max_tokens") == 1


async def test_implausible_usage_is_replaced_by_what_was_streamed(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics, logs: Logs
) -> None:
    """Old code: 1e15 tokens went to the client and the metrics as the worker said."""

    def lying(worker: FakeWorker, request: wire.Generate) -> Frames:
        del worker
        yield output(request.request_id, ANSWER, "stop", prompt_tokens=10**15, completion_tokens=10**15)

    outputs = await served(client, [fakes(lying)], metrics)
    final = outputs[-1]
    assert (final.completion_tokens, final.cached_tokens) == (len(ANSWER), 0)
    assert 0 < final.prompt_tokens < 8192
    assert find(logs, "reply_usage_replaced")[0]["completion_tokens"] == 10**15
    assert refused(metrics, "usage") == 1


async def test_a_worker_error_message_is_cut(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics
) -> None:
    """Old code: the 100 KB message went into the exception, the answer and the log line."""

    def verbose(worker: FakeWorker, request: wire.Generate) -> Frames:
        del worker
        yield wire.encode(wire.ErrorReply(request_id=request.request_id, code=500, message="x" * 100_000))

    with pytest.raises(WorkerError) as caught:
        await served(client, [fakes(verbose)], metrics)
    assert len(caught.value.message) <= MAX_WORKER_MESSAGE_CHARS + 40
    assert refused(metrics, "message_truncated") == 1


async def test_an_oversized_frame_never_reaches_the_frontend(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics, logs: Logs
) -> None:
    """libzmq refuses a frame past wire.MAX_REPLY_BYTES at the socket (the connection is dropped),
    so nothing of it is allocated or decoded; the request moves to another instance. Old code:
    its 8 MiB of token ids were decoded and answered the request (cut at max_tokens)."""
    frame = output("req-1", [1] * (wire.MAX_REPLY_BYTES + 1024))  # a token id below 128: one byte
    big, good = fakes(lambda worker, request: iter([frame])), fakes()
    outputs = await served(client, [big, good], metrics)
    assert tokens(outputs) == ANSWER
    assert big.sent == 1  # it was sent
    assert find(logs, "request_migrated")[0]["from_endpoint"] == big.endpoint


# -- row 14: a client that does not read ------------------------------------------------------


async def test_a_slow_reader_is_cancelled_past_the_buffer_bound(
    client: RequestPlaneClient, fakes: Any, metrics: FrontendMetrics, logs: Logs
) -> None:
    """Old code: every reply of an unread stream was queued (RSS grew without bound)."""
    worker = fakes(endless)
    steps = client.generate(worker.endpoint, request_for(1_000_000), request_id="slow", timeout_s=60)
    outputs: list[Output] = []
    with pytest.raises(SlowReader):
        outputs.append(await anext(steps))  # one read, then none while the worker streams on
        await until(lambda: worker.of_kind(wire.Cancel), "the worker told to stop")
        outputs += [item async for item in steps]
    await until(lambda: worker.of_kind(wire.Cancel), "the worker told to stop")  # the overflow may come first
    assert len(tokens(outputs)) <= MAX_BUFFERED_TOKENS  # what was queued at the one read, at most
    assert metrics.registry.get_sample_value("dynamo_frontend_slow_readers_total") == 1
    assert find(logs, "request_buffer_full")


# -- row 18: no first token --------------------------------------------------------------------


@pytest.mark.parametrize("moves", [0, 1])
async def test_a_worker_that_never_streams_is_failed_over_at_the_first_token_deadline(
    logs: Logs, fakes: Any, metrics: FrontendMetrics, moves: int
) -> None:
    """Old code: no such deadline; the request waited for the request timeout. Nothing reached the
    client, so the move is free: it happens with no migration budget too."""
    client = RequestPlaneClient(first_token_timeout_s=0.5, metrics=metrics)
    try:
        mute, good = fakes(lambda worker, request: iter(())), fakes()
        outputs = await served(client, [mute, good], metrics, moves=moves)
        assert tokens(outputs) == ANSWER
        (line,) = find(logs, "worker_no_first_token")
        assert (line["endpoint"], line["waited_s"]) == (mute.endpoint, 0.5)
        assert faults(metrics, "no_first_token") == 1
        await until(lambda: mute.of_kind(wire.Cancel), "the mute worker told to stop")
        assert not find(logs, "worker_stalled") and mute.endpoint in client.unreachable_endpoints()
    finally:
        await client.close()


# -- behind a real frontend ----------------------------------------------------------------------


def announce_until_added(frontend: DynamoProcess, plane: str, worker: FakeWorker) -> None:
    context: zmq.Context[Any] = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(plane)
    payload = {
        "v": 1, "kind": "announce", "sent_ms": 0, "ttl_ms": 600_000, "instance_id": "fake", "seq": 1,
        "endpoint": worker.endpoint, "card": worker.card_fields(),
    }  # fmt: skip
    try:

        def added() -> bool:
            pub.send_multipart([b"dynamo_prep.v1.card.dynamo", msgspec.msgpack.encode(payload)])
            return bool(frontend.find("model_added"))

        wait_for(added, 30, interval=0.1, message="the fake worker's model added")
    finally:
        pub.close(linger=0)
        context.term()


def test_a_real_frontend_answers_a_lying_worker_with_bounded_values(
    tmp_path: Path, procs: list[DynamoProcess]
) -> None:
    """Usage 1e15, a 100 KB error and a mute worker, one request each, through HTTP."""
    behaviours = iter(
        [
            lambda w, r: iter(
                [output(r.request_id, ANSWER, "stop", prompt_tokens=10**15, completion_tokens=10**15)]
            ),
            lambda w, r: iter(
                [wire.encode(wire.ErrorReply(request_id=r.request_id, code=500, message="y" * 100_000))]
            ),
            lambda w, r: iter(()),
        ]
    )
    worker = FakeWorker(K3, lambda w, r: next(behaviours)(w, r))  # noqa: PLW0108 - the next one per call
    plane, port = tcp_endpoint(), free_port()
    try:
        frontend = start_dynamo(
            "frontend", "--discovery-bind", plane, "--http-host", "127.0.0.1", "--http-port", str(port),
            "--cache-dir", str(tmp_path / "cache"), "--first-token-timeout", "1", log_level="info",
        )  # fmt: skip
        procs.append(frontend)
        frontend.wait_event("frontend_started", timeout=20)
        announce_until_added(frontend, plane, worker)
        body = {"model": K3, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(trust_env=False, timeout=60) as http:
            url = f"http://127.0.0.1:{port}"
            lying, verbose, mute = (http.post(f"{url}/v1/chat/completions", json=body) for _ in range(3))
            exposition = http.get(f"{url}/metrics").text
        assert lying.status_code == 200
        usage = lying.json()["usage"]
        assert usage["completion_tokens"] == len(ANSWER) and usage["prompt_tokens"] < 8192
        assert verbose.status_code == 502
        assert len(verbose.json()["error"]["message"]) < MAX_WORKER_MESSAGE_CHARS + 100
        assert mute.status_code == 503 and "no_first_token" in mute.json()["error"]["message"]
        failed = frontend.wait_event("request_failed", status=502)
        assert len(failed["error"]) <= DETAIL_CHARS
        assert max(len(json.dumps(line)) for line in frontend.snapshot()) < 4 * DETAIL_CHARS + 1000
        assert 'dynamo_frontend_worker_replies_refused_total{reason="usage"} 1.0' in exposition
        assert 'dynamo_frontend_worker_faults_total{reason="no_first_token"} 1.0' in exposition
    finally:
        worker.close()
