"""The ``dynamo-prep broker`` process: worker -> broker -> several frontends, and restarts."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from support.plane import (
    DynamoProcess,
    SubCollector,
    announces,
    start_dynamo,
    tcp_endpoint,
    wait_for,
    write_model_dir,
)

from dynamo_prep.protocol.discovery import Announce

LONG_HEARTBEAT = "30"


def start_broker(procs: list[DynamoProcess], xsub: str, xpub: str) -> DynamoProcess:
    broker = start_dynamo("broker", "--xsub", xsub, "--xpub", xpub)
    procs.append(broker)
    broker.wait_event("broker_started")
    return broker


def start_worker(procs: list[DynamoProcess], model: Path, discovery: str) -> DynamoProcess:
    worker = start_dynamo(
        "worker", "--model-path", str(model), "--discovery", discovery, "--heartbeat", LONG_HEARTBEAT
    )
    procs.append(worker)
    worker.wait_event("worker_started")
    return worker


def connect(collectors: list[SubCollector], xpub: str) -> SubCollector:
    collector = SubCollector(xpub, bind=False)
    collectors.append(collector)
    return collector


def test_two_frontends_get_the_card_and_a_late_one_at_once(
    tmp_path: Path, procs: list[DynamoProcess], collectors: list[SubCollector]
) -> None:
    xsub, xpub = tcp_endpoint(), tcp_endpoint()
    start_broker(procs, xsub, xpub)
    worker = start_worker(procs, write_model_dir(tmp_path / "m"), xsub)
    instance_id = worker.find("worker_started")[0]["instance_id"]
    early = connect(collectors, xpub)
    assert early.wait_messages(announces)[0].instance_id == instance_id
    joined = time.monotonic()
    late = connect(collectors, xpub)
    assert late.wait_messages(announces)[0].instance_id == instance_id
    assert late.snapshot()[0].at - joined < 5  # heartbeat is 30 s: this came from the subscription
    # The worker's log is read in the background: wait for its line about the second subscription.
    wait_for(lambda: len(worker.find("card_announced", reason="subscription")) >= 2, message="2 announces")


def test_broker_restart_resumes_announcements(
    tmp_path: Path, procs: list[DynamoProcess], collectors: list[SubCollector]
) -> None:
    xsub, xpub = tcp_endpoint(), tcp_endpoint()
    broker = start_broker(procs, xsub, xpub)
    start_worker(procs, write_model_dir(tmp_path / "m"), xsub)
    frontend = connect(collectors, xpub)
    frontend.wait_messages(announces)
    broker.kill()
    before = len(frontend.snapshot())
    start_broker(procs, xsub, xpub)
    wait_for(lambda: len(frontend.snapshot()) > before, 8, message="an announce through the new broker")
    assert isinstance(frontend.decoded()[-1], Announce)


def test_broker_exits_0_on_sigterm(procs: list[DynamoProcess]) -> None:
    broker = start_broker(procs, tcp_endpoint(), tcp_endpoint())
    broker.signal(signal.SIGTERM)
    assert broker.wait(5) == 0
    assert broker.find("broker_stopped")


def test_broker_bind_failure_exits_1(procs: list[DynamoProcess]) -> None:
    broker = start_dynamo("broker", "--xsub", "tcp://256.0.0.1:1", "--xpub", tcp_endpoint())
    procs.append(broker)
    assert broker.wait(5) == 1
    assert broker.find("broker_start_failed")


def test_a_plain_broker_reachable_from_other_hosts_says_so_loudly(procs: list[DynamoProcess]) -> None:
    exposed = start_dynamo("broker", "--xsub", "tcp://0.0.0.0:0", "--xpub", tcp_endpoint(), log_level="info")
    procs.append(exposed)
    line = exposed.wait_event("discovery_plane_open")
    assert line["level"] == "error" and line["exposed"] and "CURVE" in line["hint"]
    local = start_broker(procs, tcp_endpoint(), tcp_endpoint())  # loopback: nothing to shout about
    assert not local.find("discovery_plane_open")
