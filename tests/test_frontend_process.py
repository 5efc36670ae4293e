"""Real ``dynamo-prep frontend`` and ``dynamo-prep worker`` processes on loopback.

The frontend's JSON log lines (stdout) are the observable: every assertion reads them. The
frontend fetches the model files from the workers into a cache under ``tmp_path``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from support.plane import DynamoProcess, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.protocol.discovery import topic

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
KIMI_DEFAULT = "<|kimi_image_placeholder|>"

Start = Callable[..., DynamoProcess]


@pytest.fixture
def procs() -> Iterator[list[DynamoProcess]]:
    started: list[DynamoProcess] = []
    yield started
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def address() -> str:
    return tcp_endpoint()


@pytest.fixture
def frontend(procs: list[DynamoProcess], address: str, tmp_path: Path) -> Callable[[], DynamoProcess]:
    """Start the frontend (bound on ``address``, cache under tmp_path) and wait until it listens."""

    def _start() -> DynamoProcess:
        proc = start_dynamo(
            "frontend", "--discovery-bind", address, "--cache-dir", str(tmp_path / "cache"), log_level="info"
        )
        procs.append(proc)
        proc.wait_event("frontend_started")
        return proc

    return _start


@pytest.fixture
def worker(procs: list[DynamoProcess], address: str) -> Start:
    """Start a worker on the demo model announcing to ``address``; returns once it started."""

    def _start(*extra: str) -> DynamoProcess:
        proc = start_dynamo("worker", "--model-path", DEMO, "--discovery", address, *extra, log_level="info")
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
    joined = time.monotonic()
    added = fe.wait_event("model_added", timeout=6)
    assert time.monotonic() - joined < 6  # far below the 30 s heartbeat
    assert added["model"] == DEMO
    assert added["instance_id"] == instance_id(early)
    assert added["image_placeholder_token"] is None
    assert added["image_token"] == KIMI_DEFAULT
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

    killed_at = time.monotonic()
    doomed.kill()
    removed = fe.wait_event("instance_removed", timeout=5, instance_id=instance_id(doomed))
    assert removed["reason"] == "expired"
    assert time.monotonic() - killed_at < 1.0 + 0.5

    stopped_at = time.monotonic()
    polite.signal(signal.SIGTERM)
    removed = fe.wait_event("instance_removed", timeout=5, instance_id=instance_id(polite))
    assert removed["reason"] == "withdraw"
    assert time.monotonic() - stopped_at < 1.0  # not its 60 s TTL
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
