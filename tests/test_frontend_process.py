"""Real ``dynamo-prep frontend`` and ``dynamo-prep worker`` processes on loopback.

The frontend's JSON log lines (stdout) are the observable: every assertion reads them. The
frontend fetches the model files from the workers into a cache under ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from support.plane import DynamoProcess, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.frontend.config import FrontendConfig
from dynamo_prep.frontend.serve import serve_frontend
from dynamo_prep.protocol.discovery import DEFAULT_BIND, topic

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
KIMI_DEFAULT = "<|kimi_image_placeholder|>"

Start = Callable[..., DynamoProcess]


@pytest.fixture
def address() -> str:
    return tcp_endpoint()


@pytest.fixture
def frontend(procs: list[DynamoProcess], address: str, tmp_path: Path) -> Callable[[], DynamoProcess]:
    """Start the frontend (bound on ``address``, cache under tmp_path) and wait until it listens."""

    def _start() -> DynamoProcess:
        proc = start_dynamo(
            "frontend",
            "--discovery-bind",
            address,
            "--http-port",
            "0",
            "--cache-dir",
            str(tmp_path / "cache"),
            log_level="info",
        )
        procs.append(proc)
        proc.wait_event("frontend_started")
        return proc

    return _start


@pytest.fixture
def worker(procs: list[DynamoProcess], address: str) -> Start:
    """Start a worker on the demo model announcing to ``discovery`` (default: the frontend's address)."""

    def _start(*extra: str, discovery: str = address) -> DynamoProcess:
        proc = start_dynamo(
            "worker", "--model-path", DEMO, "--discovery", discovery, *extra, log_level="info"
        )
        procs.append(proc)
        proc.wait_event("worker_started")
        return proc

    return _start


def instance_id(proc: DynamoProcess) -> str:
    value: str = proc.wait_event("worker_started")["instance_id"]
    return value


def test_workers_before_and_after_a_late_frontend_converge_at_once(
    frontend: Callable[[], DynamoProcess], worker: Start
) -> None:
    early = worker("--heartbeat", "30")  # only a re-announce on subscription can reach the frontend
    fe = frontend()
    # Within 20 s, below the 30 s heartbeat: the re-announce on subscription brought it.
    added = fe.wait_event("model_added", timeout=20)
    assert added["model"] == DEMO
    assert added["instance_id"] == instance_id(early)
    declared = early.wait_event("worker_started")["declared_token"]  # depends on --flavor
    assert added["declared_token"] == declared
    assert added["rendered_token"] == (declared or KIMI_DEFAULT)
    assert added["formatter"] == "kimi_k3"
    assert added["mdcsum"] == early.wait_event("worker_started")["mdcsum"]
    late = worker()
    fe.wait_event("instance_added", instance_id=instance_id(late))
    assert {e["instance_id"] for e in fe.find("instance_added")} == {instance_id(early), instance_id(late)}
    assert len(fe.find("model_added")) == 1
    assert fe.find("discovery_plane_open")


def test_kill_expires_within_ttl_and_sigterm_withdraws_at_once(
    frontend: Callable[[], DynamoProcess], worker: Start
) -> None:
    fe = frontend()
    doomed = worker("--heartbeat", "0.2", "--ttl-ms", "1000")
    polite = worker("--heartbeat", "0.2", "--ttl-ms", "60000")
    for proc in (doomed, polite):
        fe.wait_event("instance_added", instance_id=instance_id(proc))

    doomed.kill()
    removed = fe.wait_event("instance_removed", timeout=20, instance_id=instance_id(doomed))
    assert removed["reason"] == "expired"  # its 1 s TTL (the polite one's is 60 s)

    polite.signal(signal.SIGTERM)
    # Within 20 s, not its 60 s TTL.
    removed = fe.wait_event("instance_removed", timeout=20, instance_id=instance_id(polite))
    assert removed["reason"] == "withdraw"
    assert polite.wait(5) == 0
    fe.wait_event("model_removed", model=DEMO)


def test_legacy_worker_and_a_conflicting_declaration_are_logged(
    frontend: Callable[[], DynamoProcess], worker: Start
) -> None:
    fe = frontend()
    legacy = worker("--legacy-expands-image-pad-token")
    downgrade = fe.wait_event("legacy_card_silent_downgrade", instance_id=instance_id(legacy))
    assert downgrade["level"] == "warning"
    assert downgrade["model"] == DEMO
    assert downgrade["legacy_key"] == "expands_image_pad_token"
    assert downgrade["legacy_value"] is True
    assert downgrade["rendered_instead"] == KIMI_DEFAULT
    sglang = worker("--declare-image-token", MEDIA_PAD)
    conflict = fe.wait_event("runtime_config_conflict", instance_id=instance_id(sglang))
    assert conflict["level"] == "warning"
    assert conflict["first_instance_id"] == instance_id(legacy)
    assert conflict["field"] == "image_placeholder_token"
    assert conflict["first_value"] is None
    assert conflict["later_value"] == MEDIA_PAD
    fe.wait_event("instance_added", instance_id=instance_id(sglang))
    assert len(fe.find("legacy_card_silent_downgrade")) == 1


def test_frontend_keeps_serving_after_garbage_and_stops_cleanly(
    frontend: Callable[[], DynamoProcess], worker: Start, address: str
) -> None:
    fe = frontend()
    context: zmq.Context[Any] = zmq.Context()
    peer = context.socket(zmq.XPUB)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(address)
        assert peer.poll(10_000), "the frontend never subscribed"
        assert peer.recv()[:1] == b"\x01"
        name = topic()
        for frames in (
            [name, b"\xc1"],
            [name],
            [name, b"a", b"b"],
            [name, msgspec.msgpack.encode({"v": 1, "kind": "announce", "instance_id": 7})],
            [name, msgspec.msgpack.encode({"v": 1, "kind": "nope"})],
            [name, msgspec.msgpack.encode({"v": 9, "kind": "announce"})],
            [name, msgspec.msgpack.encode({"pad": "x" * (1 << 20) + "y"})],
        ):
            peer.send_multipart(frames)
        wait_for(lambda: len({e["reason"] for e in fe.find("card_rejected")}) >= 6, 10, message="rejections")
    finally:
        peer.close(linger=0)
        context.term()
    reasons = {e["reason"] for e in fe.find("card_rejected")}
    assert reasons == {
        "undecodable",
        "frame_count",
        "invalid",
        "unknown_kind",
        "unsupported_version",
        "too_large",
    }
    served = worker()
    fe.wait_event("model_added", instance_id=instance_id(served))
    assert fe.process.poll() is None
    assert fe.stop() == 0
    fe.wait_event("frontend_stopped", exit_code=0)


def test_two_brokers_deliver_twice_and_losing_one_loses_nothing(
    procs: list[DynamoProcess], tmp_path: Path, worker: Start
) -> None:
    """Workers -> two brokers -> one frontend: duplicates dropped, a dead broker costs nothing."""
    xsubs, xpubs = [tcp_endpoint(), tcp_endpoint()], [tcp_endpoint(), tcp_endpoint()]
    brokers = []
    for xsub, xpub in zip(xsubs, xpubs, strict=True):
        broker = start_dynamo("broker", "--xsub", xsub, "--xpub", xpub, log_level="info")
        procs.append(broker)
        broker.wait_event("broker_started")
        brokers.append(broker)
    fe = start_dynamo(
        "frontend",
        "--discovery",
        ",".join(xpubs),
        "--http-port",
        "0",
        "--cache-dir",
        str(tmp_path / "cache"),
        log_level="info",
    )
    procs.append(fe)
    fe.wait_event("frontend_started", mode="connect")
    both = ",".join(xsubs)
    steady = worker("--heartbeat", "0.2", "--ttl-ms", "1000", discovery=both)
    fe.wait_event("model_added", instance_id=instance_id(steady))

    brokers[0].kill()
    # A second worker joins and dies after the first broker is gone: its expiry takes longer than
    # the steady worker's TTL, so had the steady worker lost its heartbeats it would expire first.
    probe = worker("--heartbeat", "0.2", "--ttl-ms", "1000", discovery=xsubs[1])
    fe.wait_event("instance_added", instance_id=instance_id(probe))
    probe.kill()
    fe.wait_event("instance_removed", instance_id=instance_id(probe), reason="expired")
    assert not fe.find("instance_removed", instance_id=instance_id(steady))
    assert len(fe.find("instance_added", instance_id=instance_id(steady))) == 1
    assert len(fe.find("model_added")) == 1


def test_frontend_config_defaults_to_the_embedded_plane() -> None:
    config = FrontendConfig.from_options()
    assert config.bind == (DEFAULT_BIND,) == ("tcp://127.0.0.1:7555",)  # this machine only, unless told
    assert config.connect == ()
    assert config.curve is None
    brokers = FrontendConfig.from_options(discovery=["tcp://b1:7556", "tcp://b2:7556"], namespace="ns")
    assert (brokers.bind, brokers.connect, brokers.namespace) == (
        (),
        ("tcp://b1:7556", "tcp://b2:7556"),
        "ns",
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"discovery_bind": "tcp://127.0.0.1:1", "discovery": ["tcp://b:2"]}, "not both"),
        ({"curve_secret_key": Path("k")}, "go together"),
        (
            {"discovery": ["tcp://b:2"], "curve_secret_key": Path("k"), "curve_allow_dir": Path(".")},
            "brokers",
        ),
    ],
)
def test_frontend_config_refuses_contradictions(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FrontendConfig.from_options(**options)


def test_bad_options_exit_2_with_a_json_error(procs: list[DynamoProcess], tmp_path: Path) -> None:
    proc = start_dynamo(
        "frontend", "--curve-secret-key", str(tmp_path / "missing.key_secret"), log_level="info"
    )
    procs.append(proc)
    assert proc.wait(10) == 2
    [error] = proc.find("frontend_config_error")
    assert error["level"] == "error"
    assert "--curve-allow-dir" in error["error"]


async def test_serve_frontend_returns_0_when_stopped(tmp_path: Path) -> None:
    stop = asyncio.Event()
    config = FrontendConfig(bind=("tcp://127.0.0.1:0",), cache_dir=tmp_path / "cache")
    serving = asyncio.create_task(serve_frontend(config, stop=stop))
    stop.set()
    assert await asyncio.wait_for(serving, 10) == 0
