"""Sockets and files under hostile or very large clusters (issue 20, rows 2, 3, 11 and 17).

Real frontends run under a low open-file limit (``RLIMIT_NOFILE`` 256, set before they start): at
the limit a newcomer is refused (a log line, a counter, a 503 for a request), and the frontend
keeps serving. The KV endpoint rules and the reconnect backoff are shown on a real subscriber
against real sockets: a plain TCP listener counts the connections it is offered.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from support.logs import Logs, find
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint
from test_hostile import K3, Target, k3_card
from test_watcher import LOOPBACK, Peer, announce, wait_log
from zmq.utils.monitor import parse_monitor_message

from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.discovery.builder import PreprocessorBuilder
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.discovery.watcher import DiscoveryWatcher
from dynamo_prep.limits import socket_budget
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.discovery import Instance, KvEventsEndpoint
from dynamo_prep.protocol.kv_events import END_SEQ, KVEvent
from dynamo_prep.routing.endpoints import KvEndpointRules, address_key, host_of
from dynamo_prep.routing.metrics import KvMetrics
from dynamo_prep.routing.subscriber import RECONNECT_DELAY_S, KvEventSubscriber

OPEN_FILES = 256


def low_open_files() -> None:
    """In the child before it starts: soft and hard limit 256 (the frontend cannot raise it)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


class _Sink:
    def __init__(self) -> None:
        self.resets: list[str] = []

    def apply(self, instance_id: str, events: list[KVEvent]) -> None:
        pass

    def reset(self, instance_id: str) -> None:
        self.resets.append(instance_id)


def refused(metrics: KvMetrics, reason: str) -> float:
    sample = metrics.registry.get_sample_value("dynamo_frontend_kv_follow_refused_total", {"reason": reason})
    return sample or 0.0


def metric(port: int, line_start: str) -> float:
    with httpx.Client(trust_env=False, timeout=30) as http:
        text = http.get(f"http://127.0.0.1:{port}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


# -- the rules, pure ----------------------------------------------------------------------------


def test_one_address_in_every_spelling() -> None:
    assert address_key("tcp://127.0.0.1:5557") == address_key("tcp://localhost:05557")
    assert address_key("tcp://[::ffff:10.0.0.5]:5557") == address_key("TCP://10.0.0.5:5557")
    assert address_key("tcp://10.0.0.5:5557") != address_key("tcp://10.0.0.5:5558")
    assert host_of("ipc:///tmp/kv.sock") == host_of("tcp://127.0.0.2:1") == host_of("tcp://[::1]:1")
    assert host_of("tcp://Worker-3.:1") == host_of("tcp://worker-3:2")
    assert host_of("tipc://{5560,0,0}") != host_of("tcp://127.0.0.1:1")  # no host we know: never "own"


def kv_instance(instance_id: str, endpoint: str, kv: str, replay: str | None = None) -> Instance:
    return Instance(
        instance_id=instance_id,
        endpoint=endpoint,
        kv_events=KvEventsEndpoint(endpoint=kv, replay_endpoint=replay),
    )


def test_a_kv_endpoint_serves_one_instance_on_its_own_host() -> None:
    rules = KvEndpointRules()
    worker = kv_instance("w", "tcp://10.0.0.5:7000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert rules.refusal(worker) is None
    rules.claim(worker)
    thief = kv_instance("t", "tcp://10.0.0.5:9", "tcp://10.0.0.5:5557")
    assert rules.refusal(thief) == ("endpoint_in_use", "tcp://10.0.0.5:5557 is followed for instance w")
    replay_thief = kv_instance("r", "tcp://10.0.0.5:9", "tcp://10.0.0.5:6000", "tcp://10.0.0.5:5558")
    assert rules.refusal(replay_thief) is not None and rules.refusal(replay_thief)[0] == "endpoint_in_use"  # type: ignore[index]
    assert rules.refusal(worker) is None, "its own claim is no conflict (a heartbeat, a re-add)"
    elsewhere = kv_instance("e", "tcp://10.0.0.6:7000", "tcp://10.0.0.7:5557")
    assert rules.refusal(elsewhere) == (
        "foreign_host",
        "tcp://10.0.0.7:5557 is not on the host of tcp://10.0.0.6:7000",
    )
    assert KvEndpointRules(["10.0.0.7"]).refusal(elsewhere) is None
    assert KvEndpointRules(["*"]).refusal(elsewhere) is None
    rules.release("w")
    assert rules.refusal(thief) is None, "the endpoint is free once its instance is gone"


# -- the subscriber on real sockets -------------------------------------------------------------


class Listener:
    """Plain TCP listeners that accept and close at once, counting the connections they are offered
    (what an arbitrary service does with a ZeroMQ peer)."""

    def __init__(self, count: int = 1) -> None:
        self.accepted = 0
        self._selector = selectors.DefaultSelector()
        self.ports: list[int] = []
        for _ in range(count):
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen(64)
            server.setblocking(False)
            self.ports.append(server.getsockname()[1])
            self._selector.register(server, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                server: Any = key.fileobj
                with contextlib.suppress(BlockingIOError):
                    conn, _ = server.accept()
                    self.accepted += 1
                    conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


def attempts_bound(elapsed_s: float) -> int:
    """Connections one instance may make in ``elapsed_s`` with the backoff (each delay doubling from
    RECONNECT_DELAY_S): 1 + log2(1 + t / first delay), doubled for stray libzmq retries."""
    return 2 * (2 + math.ceil(math.log2(1 + elapsed_s / RECONNECT_DELAY_S)))


async def test_reconnects_to_an_arbitrary_listener_back_off() -> None:
    """Issue 20 row 11: 20 instances at listeners that drop every connection were reconnected
    212 times a second (~10 per instance per second, forever); now each backs off exponentially."""
    listener = Listener(count=5)
    subscriber = KvEventSubscriber(_Sink())
    task = asyncio.get_running_loop().create_task(subscriber.run())
    try:
        for index, port in enumerate(listener.ports):
            endpoint = f"tcp://127.0.0.1:{port}"
            assert subscriber.add(kv_instance(f"w{index}", "tcp://127.0.0.1:1", endpoint))
        started = time.monotonic()
        while time.monotonic() - started < 4:  # an observation window: the bound scales with it
            await asyncio.sleep(0.1)
        elapsed = time.monotonic() - started
        assert listener.accepted >= len(listener.ports)  # each was tried
        assert listener.accepted <= len(listener.ports) * attempts_bound(elapsed), listener.accepted
    finally:
        subscriber.close()
        await task
        listener.close()


async def test_a_second_claim_on_a_kv_endpoint_waits_for_the_first_to_go() -> None:
    """Issue 20 row 17: an announce naming another worker's KV endpoint inherited its blocks."""
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    kv = f"tcp://127.0.0.1:{port}"
    subscriber = KvEventSubscriber(_Sink(), context=context)
    task = asyncio.get_running_loop().create_task(subscriber.run())
    try:
        assert subscriber.add(kv_instance("real", "tcp://127.0.0.1:7000", kv))
        assert not subscriber.add(kv_instance("thief", "tcp://127.0.0.1:9", kv))
        assert not subscriber.add(kv_instance("far", "tcp://127.0.0.1:9", "tcp://10.9.9.9:5557"))
        assert subscriber.instance_ids == {"real"}
        assert refused(subscriber.metrics, "endpoint_in_use") == 1
        assert refused(subscriber.metrics, "foreign_host") == 1
        subscriber.remove("real")
        await wait_async(lambda: subscriber.instance_ids == {"thief"}, "the waiting claim followed")
        assert refused(subscriber.metrics, "endpoint_in_use") == 1, "a retry is not counted again"
    finally:
        subscriber.close()
        await task
        publisher.close(linger=0)
        context.term()


async def wait_async(condition: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_no_socket_left_refuses_the_newcomer_and_retries_it() -> None:
    """Issue 20 row 2: socket creation failing with EMFILE ended the discovery watcher (and the
    frontend). Now the instance waits, counted, and is followed once sockets are free again."""
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, 12)  # before its first socket: libzmq sizes its table then
    subscriber = KvEventSubscriber(_Sink(), context=context)
    assert subscriber.max_instances == 3  # 3/4 of 12 sockets, 3 per instance
    hogs = [context.socket(zmq.PAIR) for _ in range(8)]  # someone else holds most of them
    task = asyncio.get_running_loop().create_task(subscriber.run())
    try:
        assert subscriber.add(kv_instance("a", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
        assert not subscriber.add(kv_instance("b", "tcp://127.0.0.1:1", "tcp://127.0.0.1:3"))
        assert refused(subscriber.metrics, "socket_limit") == 1
        assert subscriber.waiting_ids == {"b"}
        for hog in hogs:
            hog.close(linger=0)
        await wait_async(lambda: subscriber.instance_ids == {"a", "b"}, "b followed once sockets are free")
        assert subscriber.add(kv_instance("c", "tcp://127.0.0.1:1", "tcp://127.0.0.1:4"))
        assert not subscriber.add(kv_instance("d", "tcp://127.0.0.1:1", "tcp://127.0.0.1:5")), "the share"
        assert subscriber.instance_ids == {"a", "b", "c"}
        assert refused(subscriber.metrics, "socket_limit") == 2
    finally:
        subscriber.close()
        await task
        context.term()


async def test_the_replay_dealer_lives_only_while_a_replay_is_outstanding() -> None:
    """Between replays an instance holds no DEALER (two descriptors per instance saved): the
    publisher's ROUTER sees it connect for the catch-up and go once the replay ended."""
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    live = publisher.bind_to_random_port("tcp://127.0.0.1")
    router = context.socket(zmq.ROUTER)
    replay = router.bind_to_random_port("tcp://127.0.0.1")
    events = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    subscriber = KvEventSubscriber(_Sink(), context=context)
    task = asyncio.get_running_loop().create_task(subscriber.run())
    try:
        kv = f"tcp://127.0.0.1:{live}"
        assert subscriber.add(kv_instance("w", "tcp://127.0.0.1:1", kv, f"tcp://127.0.0.1:{replay}"))
        identity, *_ = await router.recv_multipart()
        await router.send_multipart([identity, b"", b"", END_SEQ, b""])  # nothing buffered: the end
        seen = []
        while zmq.EVENT_DISCONNECTED not in seen:
            message = await asyncio.wait_for(events.recv_multipart(), 15)
            seen.append(parse_monitor_message(message)["event"])
        assert seen == [zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED]
        assert subscriber.instance_ids == {"w"}
    finally:
        subscriber.close()
        await task
        events.close(linger=0)
        for sock in (publisher, router):
            sock.close(linger=0)
        context.term()


class _FailingListener:
    """A KV router that cannot take an instance (no socket left, say): it raises."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def instance_added(self, card: ModelDeploymentCard, instance: Instance) -> None:
        self.added.append(instance.instance_id)
        raise zmq.ZMQError(errno.EMFILE)

    def instance_removed(self, model: str, instance: Instance) -> None:
        raise zmq.ZMQError(errno.EMFILE)


async def test_the_discovery_watcher_outlives_a_failing_listener(tmp_path: Path, logs: Logs) -> None:
    """Issue 20 row 2: the KV router's ZMQError('Too many open files') ended the watcher (and the
    frontend). A listener's failure is now logged and counted; the plane goes on."""
    context = zmq.asyncio.Context()
    store = ModelFileStore(tmp_path / "cache")
    builder = PreprocessorBuilder(store, local_model_path=resolve_model_dir(K3), fetch_timeout_s=1.0)
    listener = _FailingListener()
    watcher = DiscoveryWatcher(builder=builder, bind=[LOOPBACK], context=context, listeners=[listener])
    watcher.open()
    task = asyncio.get_running_loop().create_task(watcher.run())
    peer = Peer(context, watcher.addresses[0])
    try:
        await peer.subscribed()
        raw = encode_card(ModelDeploymentCard.from_model_dir(K3))
        for index in range(3):
            await peer.publish(announce(f"w{index}", 1, raw))
        await wait_log(logs, "instance_added", instance_id="w2")
        assert listener.added == ["w0", "w1", "w2"]
        assert not task.done()
        assert watcher.metrics.listener_failures._value.get() == 3
        assert len(find(logs, "instance_listener_failed")) == 1  # once a second
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        peer.close()
        context.destroy(linger=0)


# -- limits at start -----------------------------------------------------------------------------


def test_the_frontend_raises_its_open_file_limit_and_fits_its_socket_cap(tmp_path: Path) -> None:
    def soft_low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 2000))

    proc = start_dynamo(
        "frontend", "--discovery-bind", tcp_endpoint(), "--http-port", str(free_port()),
        "--cache-dir", str(tmp_path), log_level="info", preexec_fn=soft_low,
    )  # fmt: skip
    try:
        limits = proc.wait_event("process_limits_set", timeout=30)
        assert limits["open_files_before"] == 300 and limits["open_files"] == 2000
        assert limits["zmq_max_sockets_before"] == 1023
        assert limits["zmq_max_sockets"] == socket_budget(2000, 65535)
        proc.wait_event("frontend_started", timeout=30)
    finally:
        proc.stop()


# -- real frontends at a low open-file limit ----------------------------------------------------


class Fleet:
    """Live workers on the cheap: ONE ROUTER bound on ``count`` ports answers every Generate with a
    one-token answer and every Ping with a Pong (an instance per port)."""

    def __init__(self, count: int) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.endpoints = [
            f"tcp://127.0.0.1:{self._router.bind_to_random_port('tcp://127.0.0.1')}" for _ in range(count)
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            identity, payload = self._router.recv_multipart()
            message = wire.decode_to_worker(payload)
            if isinstance(message, wire.Ping):
                reply: wire.FromWorker = wire.Pong(request_id=message.request_id)
            elif isinstance(message, wire.Generate):
                prompt = len(message.request.token_ids)
                reply = wire.Output(
                    request_id=message.request_id, token_ids=[100], finish_reason="stop",
                    prompt_tokens=prompt, completion_tokens=1,
                )  # fmt: skip
            else:
                continue
            self._router.send_multipart([identity, wire.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(linger=0)
        self._context.term()


@pytest.fixture
def low_target(tmp_path: Path, procs: list[DynamoProcess]) -> Iterator[Target]:
    """A frontend (kv mode) at 256 open files, with one real kimi-k3-demo worker publishing KV events."""
    made = Target(tmp_path, procs)
    http = ("--http-host", "127.0.0.1", "--http-port", str(made.port))
    made.frontend = start_dynamo(
        "frontend", "--discovery-bind", made.plane, *http, "--cache-dir", str(tmp_path / "cache"),
        "--router-mode", "kv", log_level="info", preexec_fn=low_open_files,
    )  # fmt: skip
    procs.append(made.frontend)
    worker = start_dynamo(
        "worker", "--model-path", K3, "--discovery", made.plane, "--token-delay", "0", "--heartbeat", "0.3",
        "--kv-events",
    )  # fmt: skip
    procs.append(worker)
    made.worker_id = worker.wait_event("worker_started")["instance_id"]
    made.frontend.wait_event("model_added", timeout=30)
    made.frontend.wait_event("kv_events_subscribed", instance_id=made.worker_id, timeout=30)
    yield made
    made.close()


def kv_announce(target: Target, instance_id: str, endpoint: str, kv: str) -> dict[str, Any]:
    return {
        **target.announce(instance_id, seq=1, endpoint=endpoint, card=k3_card()),
        "kv_events": {"endpoint": kv},
    }


def test_hundreds_of_kv_publishers_at_the_file_limit_are_refused_not_fatal(low_target: Target) -> None:
    """Issue 20 row 2: 300 instances announced with KV endpoints; the frontend exited with
    ZMQError('Too many open files') in the discovery watcher."""
    frontend = low_target.frontend
    assert frontend is not None
    announces = [
        kv_announce(low_target, f"kv-{index}", "tcp://127.0.0.1:9", f"tcp://127.0.0.1:{20000 + index}")
        for index in range(300)
    ]
    low_target.flood(announces, lambda: len(frontend.find("instance_added")) >= 301, "300 admitted")
    frontend.wait_event("kv_events_refused", reason="socket_limit", timeout=20)
    assert frontend.process.poll() is None
    assert not frontend.find("frontend_component_failed")
    assert [low_target.chat(f"q{index}").status_code for index in range(3)] == [200] * 3
    assert low_target.live_s() < 5
    assert metric(low_target.port, 'dynamo_frontend_kv_follow_refused_total{reason="socket_limit"}') > 0


def test_more_live_workers_than_sockets_get_503s_not_500s(tmp_path: Path, procs: list[DynamoProcess]) -> None:
    """Issue 20 row 3: 1,100 live instances round robin; chats 1,022 onward got HTTP 500 ('Too many
    open files'). At 256 open files the same happens after ~90: each is now a 503 naming the limit."""
    target = Target(tmp_path, procs)
    http = ("--http-host", "127.0.0.1", "--http-port", str(target.port))
    target.frontend = start_dynamo(
        "frontend", "--discovery-bind", target.plane, *http, "--cache-dir", str(tmp_path / "cache"),
        log_level="info", preexec_fn=low_open_files,
    )  # fmt: skip
    procs.append(target.frontend)
    worker = start_dynamo("worker", "--model-path", K3, "--discovery", target.plane, "--token-delay", "0")
    procs.append(worker)
    target.frontend.wait_event("model_added", timeout=30)
    fleet = Fleet(150)
    try:
        announces = [
            target.announce(f"live-{index}", seq=1, endpoint=endpoint, card=k3_card())
            for index, endpoint in enumerate(fleet.endpoints)
        ]
        frontend = target.frontend
        target.flood(announces, lambda: len(frontend.find("instance_added")) >= 151, "150 admitted")
        with ThreadPoolExecutor(8) as pool:  # quick: channels close after 30 s idle, freeing sockets
            answers = list(pool.map(target.chat, [f"q{index}" for index in range(160)]))
        statuses = {answer.status_code for answer in answers}
        assert statuses <= {200, 503}, statuses
        refusals = [answer for answer in answers if answer.status_code == 503]
        assert refusals, "256 open files cannot hold 150 channels: some chats must be refused"
        assert "open-socket limit" in refusals[0].json()["error"]["message"]
        assert frontend.process.poll() is None
        frontend.wait_event("request_plane_refused", reason="socket_limit")
        assert metric(target.port, "dynamo_frontend_request_plane_refused_total") >= len(refusals)
        assert target.live_s() < 5
    finally:
        fleet.close()
        target.close()


def test_an_announce_naming_another_workers_kv_endpoint_is_not_followed(low_target: Target) -> None:
    """Issue 20 row 17: it inherited the worker's cache claims and took 10 of its 20 prompts."""
    frontend = low_target.frontend
    assert frontend is not None
    real = frontend.find("kv_events_subscribed", instance_id=low_target.worker_id)[0]
    thief = kv_announce(low_target, "thief", "tcp://127.0.0.1:9", real["endpoint"])
    low_target.flood([thief], lambda: frontend.find("kv_events_refused", instance_id="thief"), "refusal")
    assert frontend.find("kv_events_refused", instance_id="thief")[0]["reason"] == "endpoint_in_use"
    assert not frontend.find("kv_events_subscribed", instance_id="thief")
    far = kv_announce(low_target, "far", "tcp://127.0.0.1:9", "tcp://10.200.0.1:5557")
    low_target.flood([far], lambda: frontend.find("kv_events_refused", instance_id="far"), "refusal")
    assert frontend.find("kv_events_refused", instance_id="far")[0]["reason"] == "foreign_host"


def test_raise_limits_never_goes_past_the_hard_limit() -> None:
    """In a child whose hard limit is 512: the soft limit goes to 512 and no further."""
    code = (
        "import resource, zmq; from dynamo_prep.limits import raise_limits; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (128, 512)); c = zmq.Context(); raise_limits(c); "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], c.get(zmq.MAX_SOCKETS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split()[-2:] == ["512", str(socket_budget(512, 65535))]  # after the log line


@pytest.fixture
def healthy(tmp_path: Path, procs: list[DynamoProcess]) -> Iterator[Target]:
    """A frontend at the default limits with one real kimi-k3-demo worker (test_hostile's target)."""
    made = Target(tmp_path, procs)
    made.start()
    yield made
    made.close()


def test_an_endpoint_libzmq_refuses_is_routed_around_never_a_500(healthy: Target) -> None:
    """An announce whose endpoint is no ZeroMQ address: each request routed there was a 500, and
    its DEALER was never closed (a descriptor leaked per request). Now it is unreachable at once:
    the request moves to the real worker for free, the socket is closed."""
    frontend = healthy.frontend
    assert frontend is not None
    bad = healthy.announce("bad", seq=1, endpoint="nonsense://x", card=k3_card())
    healthy.flood([bad], lambda: frontend.find("instance_added", instance_id="bad"), "bad admitted")
    assert [healthy.chat(f"q{index}").status_code for index in range(4)] == [200] * 4
    assert frontend.find("worker_unreachable", endpoint="nonsense://x")
