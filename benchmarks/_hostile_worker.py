"""What the hostile-worker suites (``hostile_engines``, ``hostile_replies``) share: a real frontend
logging to a file, a raw worker announced on its plane until the frontend has it, and ``/live``
polled by a process of its own around an attack."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq

from benchmarks._plane import FileProcess
from benchmarks.hostile import PLANE_TOPIC, LogTail, Poller

__all__ = ["announce", "live_max_ms", "polled", "start_frontend"]

T = TypeVar("T")
LIVE_INTERVAL_MS = 10.0
RAW_INSTANCE = "hostile"


def start_frontend(
    procs: list[FileProcess], tmp: Path, plane: str, port: int, *flags: str, log_level: str
) -> LogTail:
    """A frontend binding ``plane``, serving HTTP on ``port`` and logging to ``tmp/frontend.log``
    (added to ``procs`` at once), and its log once it has started; ``flags``: more of its options."""
    frontend = FileProcess(
        ["--log-level", log_level, "frontend", "--discovery-bind", plane, "--http-host", "127.0.0.1",
         "--http-port", str(port), "--cache-dir", str(tmp / "cache"), *flags],
        tmp / "frontend.log",
    )  # fmt: skip
    procs.append(frontend)
    log = LogTail(frontend.log_path)
    log.wait("frontend_started")
    return log


def announce(plane: str, log: LogTail, endpoint: str, card: dict[str, Any]) -> None:
    """Announce a raw worker (instance ``hostile``) at ``endpoint`` with ``card`` until the frontend
    logs it added."""
    context: zmq.Context[Any] = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(plane)
    payload = {
        "v": 1, "kind": "announce", "sent_ms": 0, "ttl_ms": 600_000, "instance_id": RAW_INSTANCE,
        "seq": 1, "endpoint": endpoint, "card": card,
    }  # fmt: skip
    deadline = time.monotonic() + 30
    while not log.find("instance_added", instance_id=RAW_INSTANCE):
        assert time.monotonic() < deadline, "the raw worker was never added"
        pub.send_multipart([PLANE_TOPIC, msgspec.msgpack.encode(payload)])
        time.sleep(0.1)  # the resend period (slow joiner); the log decides
    pub.close(linger=0)
    context.term()


def polled(port: int, tmp: Path, attack: Callable[[], T]) -> tuple[T, list[tuple[float, float, int]]]:
    """What ``attack`` returns, and the ``/live`` samples taken every 10 ms while it ran."""
    poller = Poller(port, LIVE_INTERVAL_MS, tmp / "live.txt")
    try:
        result = attack()
    finally:
        samples = poller.stop()
    return result, samples


def live_max_ms(samples: list[tuple[float, float, int]]) -> float:
    return round(max(latency for _, latency, _ in samples), 1)
