"""Issue 20, rows 10, 13, 14, 15 and 18: a real frontend against a hostile worker's replies.

``python -m benchmarks.hostile_replies [--only NAME ...]``

A real ``dynamo-prep frontend`` (logs to a file), a raw-pyzmq worker (``tests/support/fake_worker.py``)
announced on its plane, and for the attacks that fail over, a real mock worker of the same model
(``--migration-limit 1``). ``/live`` is polled every 10 ms by a process of its own
(``benchmarks.hostile``'s poller). Per attack: what the client got and how long it waited, the
frontend's peak RSS, the longest ``/live``, the bytes the frontend logged, and its log lines about
the worker. The slow reader's model announces a 1M-token context (so its stream outlasts every
buffer between the frontend and a client that never reads). For the old code, run it from a
checkout of the old tree (``git archive <commit> | tar -x -C DIR``, with this file,
``benchmarks/_hostile_worker.py`` and ``tests/support/fake_worker.py`` copied in): the frontend runs
as ``python -m dynamo_prep.cli`` from the current directory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._hostile_worker import announce, live_max_ms, polled, start_frontend
from benchmarks._plane import DEMO_MODEL, FileProcess, free_port, reap, tcp_endpoint
from benchmarks._rows import named, run_rows
from benchmarks.hostile import LogTail
from dynamo_prep.protocol import wire

FIRST_TOKEN_TIMEOUT_S = 5.0  # DYN_FIRST_TOKEN_TIMEOUT here (the old code ignores it)

from support.fake_worker import FakeWorker, Frames  # noqa: E402  (tests/ is on the path: _plane)

WORKER_EVENTS = ("worker_dropped", "reply_rejected", "worker_no_first_token", "worker_lost",
                 "reply_usage_replaced", "request_buffer_full", "request_migrated")  # fmt: skip
TOKEN = 3_000  # an ordinary id of the demo vocabulary
WIDE_TOKEN = 2_623  # the demo vocabulary's longest token (39 spaces): a client's buffers fill fast


def output(request_id: str, tokens: list[int], finish: str | None = None, **usage: int) -> bytes:
    return wire.encode(wire.Output(request_id=request_id, token_ids=tokens, finish_reason=finish, **usage))


def flood(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Row 10: 3.2M replies for request ids nobody asked for."""
    del worker, request
    return (output(f"flood-{index}", []) for index in range(3_200_000))


def garbage(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Row 15: undecodable frames for 5 s."""
    del worker, request
    until = time.monotonic() + 5.0
    return (b"\xc1garbage that is not msgpack" for _ in iter(lambda: time.monotonic() < until, False))


def huge_usage(worker: FakeWorker, request: wire.Generate) -> Frames:
    del worker
    yield output(request.request_id, [TOKEN] * 3, "stop", prompt_tokens=10**15, completion_tokens=10**15)


def huge_error(worker: FakeWorker, request: wire.Generate) -> Frames:
    del worker
    yield wire.encode(wire.ErrorReply(request_id=request.request_id, code=500, message="x" * 100_000))


def many_tokens(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Row 13: 50M tokens, 10,000 a frame, then a final message."""
    del worker
    for _ in range(5_000):
        yield output(request.request_id, [TOKEN] * 10_000)
    yield output(request.request_id, [], "stop")


def fast_stream(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Row 14: 16 wide tokens a frame, as fast as the socket takes them, until cancelled."""
    for index in range(20_000_000):
        if index % 4096 == 0 and worker.of_kind(wire.Cancel):
            return
        yield output(request.request_id, [WIDE_TOKEN, TOKEN] * 8)


@dataclass
class Bench:
    tmp: Path
    request_timeout_s: float
    procs: list[FileProcess] = field(default_factory=list)
    plane: str = field(default_factory=tcp_endpoint)
    port: int = field(default_factory=free_port)
    log: LogTail | None = None

    def start(self, *, healthy: bool) -> None:
        os.environ["DYN_FIRST_TOKEN_TIMEOUT"] = str(FIRST_TOKEN_TIMEOUT_S)
        timeout = ("--request-timeout", str(self.request_timeout_s))
        self.log = start_frontend(self.procs, self.tmp, self.plane, self.port, *timeout, log_level="info")
        if healthy:
            args = ["--log-level", "info", "worker", "--model-path", DEMO_MODEL, "--discovery", self.plane,
                    "--token-delay", "0", "--migration-limit", "1"]  # fmt: skip
            self.procs.append(FileProcess(args, self.tmp / "worker.log"))
            self.log.wait("model_added", timeout=60)

    def announce(self, worker: FakeWorker, **card: Any) -> None:
        assert self.log is not None
        announce(self.plane, self.log, worker.endpoint, worker.card_fields(migration_limit=1, **card))
        self.log.wait("model_added", timeout=60)

    def chat(self, *, stream: bool = False, **fields: Any) -> tuple[int, float, Any]:
        body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
        started = time.monotonic()
        with httpx.Client(trust_env=False, timeout=self.request_timeout_s + 30) as http:
            response = http.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json={**body, **fields})
        return response.status_code, time.monotonic() - started, response.text

    def rss_mb(self) -> tuple[float, float]:
        """(current, peak) RSS of the frontend in MB."""
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{self.procs[0].pid}/status").read_text().splitlines()
        )
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        reap(self.procs)


def to_hostile(bench: Bench) -> dict[str, Any]:
    """Two chats in a row: round robin sends one of them to the hostile worker."""
    results = [bench.chat(max_tokens=8)[:2] for _ in range(2)]
    return {"chats": [f"{status} in {seconds:.2f} s" for status, seconds in results]}


def one_chat(bench: Bench) -> dict[str, Any]:
    status, seconds, text = bench.chat()
    answer = json.loads(text)
    error = answer.get("error", {}).get("message", "")
    return {
        "status": status,
        "seconds": round(seconds, 3),
        "usage": answer.get("usage"),
        "answer_chars": len(text),
        "error_chars": len(error),
    }


def slow_reader(bench: Bench, seconds: float = 20.0) -> dict[str, Any]:
    """A streaming chat whose client never reads; the frontend's RSS each second."""
    body = json.dumps(
        {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    client = socket.create_connection(("127.0.0.1", bench.port))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.sendall(head + body)
    samples = []
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        samples.append((round(elapsed), round(bench.rss_mb()[0])))
        time.sleep(1.0)  # the sampling period of the figure
    client.close()
    return {"rss_mb_each_second": [mb for _, mb in samples]}


@dataclass
class Attack:
    name: str
    row: int
    behaviour: Callable[[FakeWorker, wire.Generate], Frames]
    client: Callable[[Bench], dict[str, Any]]
    healthy: bool = False
    card: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 60.0


ATTACKS = (
    Attack("flood", 10, flood, to_hostile, healthy=True),
    Attack("usage_1e15", 13, huge_usage, one_chat),
    Attack("error_100kb", 13, huge_error, one_chat),
    Attack("tokens_50m", 13, many_tokens, one_chat),
    Attack("slow_reader", 14, fast_stream, slow_reader, card={"context_length": 1_048_576}),
    Attack("garbage", 15, garbage, to_hostile, healthy=True),
    Attack("no_first_token", 18, lambda worker, request: iter(()), to_hostile, healthy=True,
           request_timeout_s=30.0),
)  # fmt: skip


def measure(attack: Attack, tmp: Path) -> dict[str, Any]:
    bench = Bench(tmp, attack.request_timeout_s)
    worker = FakeWorker(DEMO_MODEL, attack.behaviour)
    try:
        bench.start(healthy=attack.healthy)
        bench.announce(worker, **attack.card)
        result, samples = polled(bench.port, tmp, lambda: attack.client(bench))
        assert bench.log is not None
        events = bench.log.refresh()
        result.update(
            live_max_ms=live_max_ms(samples),
            live_failed=sum(1 for _, _, status in samples if status != 200),
            rss_peak_mb=round(bench.rss_mb()[1]),
            log_mb=round((tmp / "frontend.log").stat().st_size / 2**20, 2),
            longest_log_line=max(len(json.dumps(event)) for event in events),
            worker_lines={name: n for name in WORKER_EVENTS if (n := len(bench.log.find(name)))},
            frames_sent=worker.sent,
            cancels=len(worker.of_kind(wire.Cancel)),
        )
        return result
    finally:
        bench.stop()
        worker.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile_replies", description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="attacks whose name contains one of these")
    args = parser.parse_args()
    return run_rows(named(args.only, ATTACKS), measure, "attack")


if __name__ == "__main__":
    raise SystemExit(main())
