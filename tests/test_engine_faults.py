"""Busy, hung and dead engines told apart (issue 25, rows 9, 10, 12, 14, 15), with real processes.

A real frontend and real mock workers on loopback. The mock worker models what a real engine does
to its worker from outside: SIGUSR1 holds its engine's steps (a stopped engine core: the worker's
process, heartbeats and request plane go on), SIGUSR2 keeps its event loop busy for longer than a
short TTL (``worker.mock.MOCK_FAULT_SIGNALS``), ``--slots`` bounds its batch (a saturated engine),
and ``--kv-events --prefill-ms-per-1k`` queues its prefills (a busy engine). Whole processes are
stopped with SIGSTOP and killed with SIGKILL. Every wait is a condition with a deadline.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from support.cluster import Processes, Streamed, stream_chat
from support.plane import DynamoProcess, wait_for

DEMO = "kimi-k3-demo"
LONG_TEXT = "please keep talking for a while, so that this stream lasts long enough to be interrupted"
CLIENT_TIMEOUT_S = 60.0
HOLD = signal.SIGUSR1  # the mock's engine held (again: released)
STARVE = signal.SIGUSR2  # the mock's loop busy for worker.mock.STARVE_S
# A structured output long enough to be interrupted: every property a 24-character string.
SCHEMA = {
    "type": "object",
    "properties": {f"field_{index}": {"type": "string", "minLength": 24} for index in range(8)},
    "required": [f"field_{index}" for index in range(8)],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "long", "schema": SCHEMA}}


class Pool(Processes):
    """One test's frontend and workers of the demo model (all real processes, logging at debug)."""

    def worker(self, *flags: str) -> DynamoProcess:
        return self.start_worker("--model-path", DEMO, "--flavor", "sglang", "--heartbeat", "0.2", *flags)

    def serving(self, by_id: dict[str, DynamoProcess]) -> DynamoProcess:
        """The worker the frontend routed its latest request to."""
        assert self.frontend is not None
        return by_id[self.frontend.find("request_routed")[-1]["instance_id"]]


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    with Pool(tmp_path, log_level="debug") as started:
        yield started


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def body(text: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": DEMO, "messages": [{"role": "user", "content": text}], "stream": stream, **extra}


def answer(http: httpx.Client, url: str, text: str, **extra: Any) -> str:
    response = http.post(f"{url}/v1/chat/completions", json=body(text, **extra))
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def stream(
    http: httpx.Client, url: str, text: str, on_chunk: Callable[[int], None] = lambda _: None, **extra: Any
) -> Streamed:
    return stream_chat(http, url, body(text, stream=True, **extra), on_chunk)


# -- row 9: a hung engine ------------------------------------------------------------------------


def test_a_hung_engine_mid_stream_moves_and_completes(pool: Pool, http: httpx.Client) -> None:
    """The serving worker's engine stops making steps after 3 chunks, its process and heartbeats
    going on (before: the stream stalled until the request timeout, the worker logged nothing). Its
    watchdog withdraws it and fails the stream over with a 503; the stream ends on the other worker
    exactly as if nothing had happened, and the hung worker exits 1."""
    frontend = pool.start_frontend()
    flags = ("--token-delay", "0.04", "--migration-limit", "1", "--engine-stall-timeout", "1")
    by_id = pool.live(pool.worker(*flags), pool.worker(*flags))
    expected = answer(http, pool.url, LONG_TEXT)
    held: list[DynamoProcess] = []

    def hold_the_engine(chunks: int) -> None:
        if chunks == 3:
            held.append(pool.serving(by_id))
            held[0].signal(HOLD)

    streamed = stream(http, pool.url, LONG_TEXT, hold_the_engine)
    assert streamed.done and streamed.error is None, streamed.error
    assert streamed.text == expected
    [hung] = held
    hung.wait_event("mock_engine_held", timeout=30)
    assert hung.wait_event("engine_stalled", timeout=30)["in_flight"] == 1
    assert hung.wait(timeout=30) == 1
    order = [event["event"] for event in hung.snapshot()]
    assert order.index("card_withdrawn") > order.index("engine_stalled")
    migrated = frontend.wait_event("request_migrated", timeout=10)
    assert migrated["streamed_tokens"] >= 3 and "503" in migrated["reason"]
    assert answer(http, pool.url, "still there?").endswith("still there?")


def test_a_stream_whose_tokens_stop_moves_at_the_frontend_s_stall_deadline(
    pool: Pool, http: httpx.Client
) -> None:
    """The same hung engine with the worker's watchdog off: the frontend's own inter-token deadline
    (``--stream-stall-timeout``) gives up on that worker, though it answers every ping, and the
    stream continues on the other one."""
    frontend = pool.start_frontend("--stream-stall-timeout", "1")
    flags = ("--token-delay", "0.04", "--migration-limit", "1", "--engine-stall-timeout", "0")
    by_id = pool.live(pool.worker(*flags), pool.worker(*flags))
    expected = answer(http, pool.url, LONG_TEXT)
    held: list[DynamoProcess] = []

    def hold_the_engine(chunks: int) -> None:
        if chunks == 3:
            held.append(pool.serving(by_id))
            held[0].signal(HOLD)

    streamed = stream(http, pool.url, LONG_TEXT, hold_the_engine)
    assert streamed.done and streamed.error is None, streamed.error
    assert streamed.text == expected
    assert frontend.wait_event("worker_stream_stalled", timeout=10)["reason"] == "stalled_stream"
    held[0].wait_event("mock_engine_held", timeout=30)
    assert held[0].process.poll() is None  # a worker without a watchdog lives on, held
    assert not frontend.find("instance_removed")


# -- row 10: a starved worker ---------------------------------------------------------------------


def test_an_expired_instance_keeps_the_streams_it_still_delivers(pool: Pool, http: httpx.Client) -> None:
    """The only worker is frozen mid-stream (SIGSTOP) until the frontend expires its instance, then
    thawed: a host starved for the TTL. Its stream was not failed at the expiry (before: 503, the
    worker lost) and ends whole, on the same worker, without a move."""
    frontend = pool.start_frontend("--worker-stall-timeout", "40")  # an expired channel: 10 s of grace
    worker = pool.worker("--token-delay", "0.05", "--ttl-ms", "1000")
    pool.live(worker)
    expected = answer(http, pool.url, LONG_TEXT)

    def freeze_until_expired(chunks: int) -> None:
        if chunks == 3:
            worker.signal(signal.SIGSTOP)
            try:
                frontend.wait_event("instance_removed", timeout=20, reason="expired")
            finally:
                worker.signal(signal.SIGCONT)

    streamed = stream(http, pool.url, LONG_TEXT, freeze_until_expired)
    assert streamed.done and streamed.error is None, streamed.error
    assert streamed.text == expected
    assert frontend.find("worker_expired_delivering")
    assert not frontend.find("request_migrated") and not frontend.find("worker_lost")


def test_a_starved_worker_loop_keeps_its_heartbeats_and_its_stream(pool: Pool, http: httpx.Client) -> None:
    """The worker's event loop runs Python for 2.5 s mid-stream, twice its TTL (before: no
    heartbeat left it, the instance expired and the stream failed). Heartbeats come from a thread
    of their own: the instance never expires and the stream ends whole."""
    frontend = pool.start_frontend()
    worker = pool.worker("--token-delay", "0.05", "--ttl-ms", "1000")
    pool.live(worker)
    expected = answer(http, pool.url, LONG_TEXT)

    def starve(chunks: int) -> None:
        if chunks == 3:
            worker.signal(STARVE)

    streamed = stream(http, pool.url, LONG_TEXT, starve)
    assert streamed.done and streamed.error is None, streamed.error
    assert streamed.text == expected
    worker.wait_event("mock_loop_starved", timeout=10)
    assert answer(http, pool.url, "after the starvation").endswith("after the starvation")
    assert not frontend.find("instance_removed")


# -- row 15: busy and saturated pools ---------------------------------------------------------------


def test_a_busy_instance_keeps_a_queued_request_past_the_first_token_timeout(
    pool: Pool, http: httpx.Client
) -> None:
    """Three long prompts at once to one worker whose prefills queue (1.5 s each) and whose heartbeat
    says so: the last waits far past the 2 s first-token timeout (before: it was given up on, 503),
    and every one is answered."""
    frontend = pool.start_frontend("--first-token-timeout", "2")
    worker = pool.worker("--token-delay", "0.01", "--kv-events", "--prefill-ms-per-1k", "1500")
    pool.live(worker)
    statuses: list[int] = []

    def ask(index: int) -> None:
        prompt = f"prompt {index}: " + " ".join(f"w{index}x{word}" for word in range(400))  # ~1,000 tokens
        response = http.post(f"{pool.url}/v1/chat/completions", json=body(prompt))
        statuses.append(response.status_code)

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_S)
    assert statuses == [200, 200, 200]
    assert frontend.find("worker_busy_kept", phase="first_token")
    assert not frontend.find("worker_no_first_token")


def test_a_saturated_pool_queues_to_a_bound_then_refuses_with_retry_after(
    pool: Pool, http: httpx.Client
) -> None:
    """Two workers running one request each (``--slots 1``) and both busy: a third request waits at
    the frontend (it is not piled onto a full engine) and is served when a slot frees; a fourth,
    past the one-request queue, gets a 503 with Retry-After at once."""
    frontend = pool.start_frontend("--max-queued-requests", "1")
    flags = ("--token-delay", "0.05", "--slots", "1")
    pool.live(pool.worker(*flags), pool.worker(*flags))
    running = [threading.Thread(target=stream, args=(http, pool.url, f"{LONG_TEXT} {i}")) for i in range(2)]
    for thread in running:
        thread.start()
    wait_for(lambda: len(frontend.find("request_routed")) >= 2, 20, message="both slots taken")
    queued: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: queued.append(http.post(f"{pool.url}/v1/chat/completions",
                                                                      json=body("third"))))  # fmt: skip
    waiting.start()
    frontend.wait_event("request_queued", timeout=20)
    refused = http.post(f"{pool.url}/v1/chat/completions", json=body("fourth"))
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) > 0
    assert "saturated" in refused.json()["error"]["message"]
    waiting.join(CLIENT_TIMEOUT_S)
    for thread in running:
        thread.join(CLIENT_TIMEOUT_S)
    assert queued and queued[0].status_code == 200, queued
    assert len(frontend.find("request_routed")) == 3  # the fourth was never sent to a worker


def test_a_request_queued_past_the_queue_timeout_gets_503_with_retry_after(
    pool: Pool, http: httpx.Client
) -> None:
    frontend = pool.start_frontend("--queue-timeout", "1")
    pool.live(pool.worker("--token-delay", "0.1", "--slots", "1"))
    running = threading.Thread(target=stream, args=(http, pool.url, LONG_TEXT))
    running.start()
    frontend.wait_event("request_routed", timeout=20)
    refused = http.post(f"{pool.url}/v1/chat/completions", json=body("second"))
    running.join(CLIENT_TIMEOUT_S)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"].isdigit()
    assert frontend.find("request_refused_saturated", reason="queue_timeout")


# -- row 12: structured outputs are not glued ------------------------------------------------------


def test_a_structured_stream_that_streamed_tokens_is_not_continued_elsewhere(
    pool: Pool, http: httpx.Client
) -> None:
    """The worker of a json_schema stream is killed after 3 content chunks, with a move allowed
    (before: the stream continued on the other worker, whose grammar starts again from the schema's
    root after the text sent: two JSON texts glued). The client gets a clean error event; what it
    got before is the start of the answer."""
    frontend = pool.start_frontend()
    flags = ("--token-delay", "0.04", "--migration-limit", "1")
    by_id = pool.live(pool.worker(*flags), pool.worker(*flags))
    expected = answer(http, pool.url, "a record", response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(expected), SCHEMA)

    def kill_the_server(chunks: int) -> None:
        if chunks == 3:
            pool.serving(by_id).kill()

    streamed = stream(http, pool.url, "a record", kill_the_server, response_format=RESPONSE_FORMAT)
    assert streamed.done
    assert streamed.error is not None and streamed.error["code"] == 503, streamed
    assert "structured output" in streamed.error["message"]
    assert expected.startswith(streamed.text) and streamed.chunks >= 3
    refused = frontend.wait_event("migration_refused", timeout=10)
    assert refused["reason"] == "constrained_output" and refused["streamed_tokens"] >= 3
    assert not frontend.find("request_migrated")


def test_a_structured_request_that_streamed_nothing_moves(pool: Pool, http: httpx.Client) -> None:
    """One worker's engine is held before any request: a json_schema request routed there gets no
    token, its watchdog fails it over (503) and the other worker answers it in full."""
    frontend = pool.start_frontend()
    flags = ("--token-delay", "0", "--migration-limit", "1", "--engine-stall-timeout", "1")
    held, steady = pool.worker(*flags), pool.worker(*flags)
    pool.live(held, steady)
    held.signal(HOLD)
    held.wait_event("mock_engine_held", timeout=10)
    for index in range(2):  # round robin: one of the two is routed to the held worker first
        content = answer(http, pool.url, f"record {index}", response_format=RESPONSE_FORMAT)
        jsonschema.validate(json.loads(content), SCHEMA)
    moved = frontend.wait_event("request_migrated", timeout=10)
    assert moved["streamed_tokens"] == 0
    assert not frontend.find("migration_refused")
    assert held.wait(timeout=30) == 1


def test_a_structured_request_moves_for_free_only_once(pool: Pool, http: httpx.Client) -> None:
    """Three workers, no migration budget, the first two in the round robin's order hung: a
    json_schema request moves off the first for free (it got no token), but not off the second
    (before: every move without a token was free, so a grammar that hangs engines could visit them
    all in turn). The healthy third is never asked."""
    frontend = pool.start_frontend("--first-token-timeout", "2")
    flags = ("--token-delay", "0", "--migration-limit", "0", "--engine-stall-timeout", "0")
    by_id = pool.live(*(pool.worker(*flags) for _ in range(3)))
    first, healthy, second = sorted(by_id)  # a fresh round robin: index 0, then 1 % 2 of the rest
    for instance_id in (first, second):
        by_id[instance_id].signal(HOLD)
        by_id[instance_id].wait_event("mock_engine_held", timeout=10)
    response = http.post(
        f"{pool.url}/v1/chat/completions", json=body("a record", response_format=RESPONSE_FORMAT)
    )
    assert response.status_code == 503, response.text
    [moved] = frontend.find("request_migrated")
    assert moved["from_instance_id"] == first and moved["free"] is True
    assert [event["instance_id"] for event in frontend.find("request_routed")] == [first, second]
    assert not by_id[healthy].find("request_started")
