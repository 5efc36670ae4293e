"""Faults with real processes: a worker killed mid-stream, a broker restarted under load, a frontend
restarted, a lossy discovery plane, a frozen worker, and a stopped worker's leftovers.

Every observable is a JSON log line of a real ``dynamo-prep`` process or an HTTP answer. Waits are
conditions with deadlines; the only fixed-length periods are *observation windows* (no flap may
happen during them), and those are filled with real traffic rather than slept through.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster import Processes, instance_id, stream_chat, wait_live
from support.logs import until
from support.lossy_proxy import LossyProxy
from support.plane import DynamoProcess, SubCollector, tcp_endpoint, wait_for

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import Announce

DEMO = "kimi-k3-demo"
LONG_TEXT = "please keep talking for a while, so that this stream lasts long enough to be interrupted"
REQUEST_TIMEOUT_S = 30.0


class Cluster(Processes):
    """Processes of one test: a frontend (HTTP on a fixed free port), workers of the demo model,
    brokers."""

    def worker(
        self, flavor: str, *extra: str, discovery: str = "", log_level: str | None = None
    ) -> DynamoProcess:
        return self.start_worker(
            "--model-path", DEMO, "--flavor", flavor, *extra, discovery=discovery, log_level=log_level
        )

    def broker(self, xsub: str, xpub: str) -> DynamoProcess:
        proc = self.start("broker", "--xsub", xsub, "--xpub", xpub)
        proc.wait_event("broker_started", timeout=20)
        return proc


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path) as started:
        yield started


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def body(text: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": DEMO, "messages": [{"role": "user", "content": text}], "stream": stream}


def chat(http: httpx.Client, url: str, text: str) -> tuple[int, str]:
    """Status and reply text (or the error message) of one non-streaming request."""
    response = http.post(f"{url}/v1/chat/completions", json=body(text))
    answer = response.json()
    if response.status_code != 200:
        return response.status_code, answer["error"]["message"]
    return 200, answer["choices"][0]["message"]["content"]


class Load:
    """Sequential non-streaming requests from a background thread until ``stop()`` (bounded)."""

    def __init__(self, url: str, *, max_requests: int = 2000, max_s: float = 60.0) -> None:
        self.url = url
        self.results: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._max_requests = max_requests
        self._max_s = max_s
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()

    def statuses(self) -> Counter[int]:
        return Counter(status for _, status, _ in list(self.results))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REQUEST_TIMEOUT_S + 5)

    def _run(self) -> None:
        ends_at = time.monotonic() + self._max_s
        with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
            for index in range(self._max_requests):
                if self._stop.is_set() or time.monotonic() > ends_at:
                    return
                try:
                    status, text = chat(client, self.url, f"request {index}")
                except httpx.HTTPError as exc:
                    status, text = 0, repr(exc)
                self.results.append((time.monotonic(), status, text))


# -- 1. kill -9 a worker mid-stream -----------------------------------------------------------------


@pytest.mark.parametrize("migration_limit", [1, 0])
def test_worker_killed_mid_stream_migrates_or_fails_cleanly(
    cluster: Cluster, http: httpx.Client, migration_limit: int
) -> None:
    """Two same-flavor workers; the one streaming is SIGKILLed after 3 chunks. With a migration
    budget the client reads exactly the uninterrupted reply; without one it reads a clean error
    event then ``[DONE]``. Either way the next request is served."""
    frontend = cluster.start_frontend(log_level="debug")  # request_routed names the serving instance
    options = ("--token-delay", "0.04", "--heartbeat", "0.2", "--ttl-ms", "800")
    workers = [cluster.worker("sglang", *options, "--migration-limit", str(migration_limit)) for _ in "ab"]
    wait_live(frontend, workers)
    by_instance = {instance_id(proc): proc for proc in workers}
    status, expected = chat(http, cluster.url, LONG_TEXT)
    assert status == 200 and expected.endswith(LONG_TEXT)

    def kill_the_server(chunks: int) -> None:
        if chunks == 3:
            routed = frontend.find("request_routed")[-1]  # the reference request's came before
            by_instance[routed["instance_id"]].kill()

    streamed = stream_chat(http, cluster.url, body(LONG_TEXT, stream=True), kill_the_server)
    assert streamed.done
    if migration_limit:
        assert streamed.error is None, streamed.error
        assert streamed.text == expected  # the continuation picked up exactly where it stopped
        assert frontend.find("request_migrated")
    else:
        assert streamed.error is not None and streamed.error["code"] == 503, streamed
        assert "lost" in streamed.error["message"]
        assert expected.startswith(streamed.text) and streamed.chunks >= 3
    status, reply = chat(http, cluster.url, "still there?")
    assert status == 200 and reply.endswith("still there?")
    assert frontend.process.poll() is None


def watch_for_flaps(frontend: DynamoProcess, until: float) -> list[dict[str, Any]]:
    """Observe until ``until`` (monotonic), ending early on the first ``instance_removed``."""
    wait_for(
        lambda: frontend.find("instance_removed") or time.monotonic() >= until,
        until - time.monotonic() + 5,
        interval=0.05,
        message="the observation window",
    )
    return frontend.find("instance_removed")


def newest_seqs(seen: SubCollector, *, after: float = 0.0) -> dict[str, int]:
    """The highest announce seq per instance among the messages received after ``after``."""
    seqs: dict[str, int] = {}
    for received in seen.snapshot():
        message = received.decode()
        if received.at > after and isinstance(message, Announce):
            seqs[message.instance_id] = max(seqs.get(message.instance_id, -1), message.seq)
    return seqs


# -- 2. restart the broker under load ---------------------------------------------------------------

BROKER_TTL_MS = 5000


def test_broker_restart_under_load_loses_no_instance(cluster: Cluster) -> None:
    """Workers and frontend meet at one broker. SIGKILL it mid-load and restart it on the same
    ports: requests (frontend -> worker directly) keep succeeding, announcements flow again with
    fresh seqs, and nothing expires even past a full TTL after the kill (so the frontend did hear
    the fresh announcements: without them both instances would have expired by then)."""
    xsub, xpub = tcp_endpoint(), tcp_endpoint()
    broker = cluster.broker(xsub, xpub)
    frontend = cluster.start_frontend(plane=("--discovery", xpub))
    options = ("--token-delay", "0", "--heartbeat", "0.25", "--ttl-ms", str(BROKER_TTL_MS))
    workers = [cluster.worker(flavor, *options, discovery=xsub) for flavor in ("sglang", "vllm")]
    wait_live(frontend, workers)
    ids = {instance_id(proc) for proc in workers}
    with SubCollector(xpub, bind=False) as seen:
        wait_for(lambda: newest_seqs(seen).keys() >= ids, 10, message="announces through the broker")
        load = Load(cluster.url)
        try:
            wait_for(lambda: load.statuses()[200] >= 5, 20, message="load running")
            before = newest_seqs(seen)
            killed_at = time.monotonic()
            broker.kill()
            cluster.broker(xsub, xpub)
            back_at = time.monotonic()
            assert back_at - killed_at < BROKER_TTL_MS / 1000 - 1.0, "the broker took too long to restart"
            wait_for(
                lambda: all(newest_seqs(seen, after=back_at).get(i, -1) > before[i] for i in ids),
                10,
                message="fresh announces through the restarted broker",
            )
            flaps = watch_for_flaps(frontend, killed_at + BROKER_TTL_MS / 1000 + 1.0)
        finally:
            load.stop()
    assert not flaps
    assert len(frontend.find("model_added")) == 1
    for proc in workers:
        assert len(frontend.find("instance_added", instance_id=instance_id(proc))) == 1
    statuses = load.statuses()
    assert set(statuses) == {200}, statuses  # no instance went away, so not even a 503
    during = [at for at, status, _ in load.results if killed_at < at < back_at and status == 200]
    assert during, "no request completed while the broker was down"


# -- 3. restart the frontend ------------------------------------------------------------------------

LONG_HEARTBEAT_S = 10.0


def test_frontend_restart_reconverges_on_the_new_subscription(cluster: Cluster, http: httpx.Client) -> None:
    """SIGKILL the frontend and start a new one on the same ports. With a 10 s heartbeat, it has
    the model and every instance well before any heartbeat could have told it: the workers
    re-announced on its subscription (their logs say so)."""
    first = cluster.start_frontend()
    options = ("--token-delay", "0", "--heartbeat", str(LONG_HEARTBEAT_S), "--ttl-ms", "60000")
    workers = [cluster.worker(flavor, *options, log_level="debug") for flavor in ("sglang", "vllm")]
    wait_live(first, workers)
    assert chat(http, cluster.url, "before")[0] == 200
    on_subscription = [len(proc.find("card_announced", reason="subscription")) for proc in workers]
    first.kill()
    second = cluster.start_frontend()
    started_at = time.monotonic()
    wait_live(second, workers, timeout=LONG_HEARTBEAT_S)
    converged_s = time.monotonic() - started_at
    assert converged_s < LONG_HEARTBEAT_S / 2, converged_s
    for proc, earlier in zip(workers, on_subscription, strict=True):
        assert len(proc.find("card_announced", reason="subscription")) > earlier
    assert chat(http, cluster.url, "after")[0] == 200


# -- 4. a lossy discovery plane ---------------------------------------------------------------------

LOSS = 0.3
LOSSY_WINDOW_S = 10.0


def test_lossy_discovery_plane_does_not_flap(cluster: Cluster, http: httpx.Client) -> None:
    """30% of discovery messages lost between workers and frontend (heartbeat 0.2 s, TTL 3 s): over
    10 s nothing flaps, a late worker still converges, and requests are served throughout."""
    frontend = cluster.start_frontend()
    options = ("--token-delay", "0", "--heartbeat", "0.2", "--ttl-ms", "3000")
    with LossyProxy(xsub=tcp_endpoint(), connect_xpub=cluster.discovery, loss=LOSS, seed=6) as proxy:
        workers = [cluster.worker(flavor, *options, discovery=proxy.xsub) for flavor in ("sglang", "vllm")]
        wait_live(frontend, workers)
        window_ends = time.monotonic() + LOSSY_WINDOW_S
        late = cluster.worker("sglang", *options, discovery=proxy.xsub)
        wait_live(frontend, [late])
        workers.append(late)
        statuses: Counter[int] = Counter()
        while time.monotonic() < window_ends and not frontend.find("instance_removed"):
            statuses[chat(http, cluster.url, "over a lossy plane")[0]] += 1
        counters = proxy.snapshot()
    assert not frontend.find("instance_removed")
    assert len(frontend.find("model_added")) == 1
    for proc in workers:
        assert len(frontend.find("instance_added", instance_id=instance_id(proc))) == 1
    assert counters.forwarded + counters.dropped >= 100, counters
    assert LOSS - 0.1 <= counters.loss <= LOSS + 0.1, counters
    assert statuses and set(statuses) == {200}, statuses


# -- 5. freeze a worker -----------------------------------------------------------------------------

FREEZE_TTL_MS = 1000


def test_frozen_worker_expires_then_returns_on_sigcont(cluster: Cluster, http: httpx.Client) -> None:
    """SIGSTOP one worker: it expires after its TTL and the other serves everything; SIGCONT: it
    announces again, is added again, and serves again."""
    frontend = cluster.start_frontend()
    options = ("--token-delay", "0", "--heartbeat", "0.2", "--ttl-ms", str(FREEZE_TTL_MS))
    frozen, steady = cluster.worker("sglang", *options), cluster.worker("vllm", *options)
    wait_live(frontend, [frozen, steady])
    frozen_id = instance_id(frozen)
    frozen.signal(signal.SIGSTOP)
    removed = frontend.wait_event("instance_removed", timeout=20, instance_id=frozen_id)
    assert removed["reason"] == "expired"  # its 1 s TTL: nothing else removes a frozen worker
    for index in range(4):
        status, text = chat(http, cluster.url, f"while frozen {index}")
        assert status == 200 and text.startswith("[mock vllm]"), text
    frozen.signal(signal.SIGCONT)
    wait_for(lambda: len(frontend.find("instance_added", instance_id=frozen_id)) == 2, 10, message="back")
    served: Counter[str] = Counter()
    for index in range(6):
        status, text = chat(http, cluster.url, f"thawed {index}")
        assert status == 200, text
        served[text.split("]")[0]] += 1
    assert served["[mock sglang"] >= 2, served  # round robin over two instances again
    assert frontend.process.poll() is None


# -- 5b. freeze the frontend ------------------------------------------------------------------------

STALL_TTL_MS = 2000


def test_frontend_stalled_past_the_ttl_keeps_its_instances(cluster: Cluster, http: httpx.Client) -> None:
    """Found by the soak (a starved frontend dropped every instance at once, then re-added them
    100 ms later): after a stall, the watcher expired instances before reading the announcements
    waiting in its socket. SIGSTOP the frontend until every worker has announced past its TTL
    (under the workers' 3 s ZMTP heartbeat timeout, so the connections stay up): on SIGCONT the
    fresh announcements count first and nothing expires."""
    frontend = cluster.start_frontend()
    options = ("--token-delay", "0", "--heartbeat", "0.2", "--ttl-ms", str(STALL_TTL_MS))
    workers = [cluster.worker(flavor, *options, log_level="debug") for flavor in ("sglang", "vllm")]
    wait_live(frontend, workers)
    frontend.signal(signal.SIGSTOP)
    overdue = time.monotonic() + STALL_TTL_MS / 1000 + 0.3
    for proc in workers:  # the frozen frontend's deadlines have passed and news is waiting for it
        last = len(proc.find("card_announced"))
        wait_for(lambda p=proc, n=last: time.monotonic() > overdue and len(p.find("card_announced")) > n, 10)
    frontend.signal(signal.SIGCONT)
    flaps = watch_for_flaps(frontend, time.monotonic() + 1.0)
    assert not flaps, flaps
    assert chat(http, cluster.url, "awake")[0] == 200


# -- 6. a gracefully stopped worker leaves nothing behind in the frontend ---------------------------


async def test_stopped_worker_leaves_no_request_plane_channel_behind(cluster: Cluster) -> None:
    """Found by the soak (one descriptor more per SIGTERM restart): a withdrawn worker never expires,
    so ``endpoint_lost`` never closed its channel (DEALER, two tasks, reconnects to a dead port).
    Idle channels now close themselves, and a live endpoint reopens on the next request."""
    worker = cluster.worker("sglang", "--token-delay", "0")
    endpoint: str = worker.wait_event("worker_started", timeout=20)["endpoint"]
    card = ModelDeploymentCard.from_model_dir(DEMO)
    request = OpenAIPreprocessor.new(card, DEMO).preprocess(body("hello"))
    client = RequestPlaneClient(stall_timeout_s=1.0, idle_close_s=0.3)
    try:
        for attempt in ("first", "reopened"):
            outputs = [o async for o in client.generate(endpoint, request, request_id=attempt, timeout_s=10)]
            assert outputs[-1].finish_reason == "stop"
            assert client.endpoints == [endpoint]
            await until(lambda: not client.endpoints, "the idle channel to close", 5)
        assert [o async for o in client.generate(endpoint, request, request_id="last", timeout_s=10)]
        assert worker.stop() == 0  # SIGTERM: drain, withdraw, exit
        await until(lambda: not client.endpoints, "the stopped worker's channel to close", 5)
    finally:
        await client.close()
