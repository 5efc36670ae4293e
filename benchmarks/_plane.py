"""Shared helpers of the benchmark suites: processes, CPU, percentiles, metrics, simulated workers.

``python -m benchmarks._plane publish --instances N --discovery ADDR ...`` is a *simulated worker
fleet*: one process announcing many instances of one model card, each with its own instance_id,
seq and endpoint, re-announced every heartbeat (phases spread over the heartbeat, as independently
started workers would be) and all at once on a new subscription, exactly like ``CardPublisher``.
A few such processes stand for thousands of workers without thousands of Python processes on a
2-core machine. The socket sets ``XPUB_NODROP`` so that a message a real PUB would silently drop at
the high-water mark raises ``EAGAIN`` instead and is *counted* (and then dropped, as PUB would).

It prints JSON lines on stdout: ``first_announce`` per instance (``t``: ``time.monotonic()``, a
system-wide clock on Linux, comparable across processes) when ``--trace``, ``publisher_ready`` once
connected and subscribed, and ``publisher_stats`` every second and at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for  # noqa: E402

from dynamo_prep.card import ModelDeploymentCard, encode_card  # noqa: E402
from dynamo_prep.protocol.discovery import Announce, Withdraw, encode_message, topic  # noqa: E402

__all__ = [
    "DynamoProcess",
    "FileProcess",
    "cpu_seconds",
    "free_port",
    "iso_to_epoch",
    "percentile",
    "reap",
    "running",
    "scrape_metrics",
    "spawn",
    "start_dynamo",
    "start_frontend",
    "start_publisher",
    "summary",
    "tcp_endpoint",
    "wait_for",
]

DEMO_MODEL = "kimi-k3-demo"
MAX_RUN_S = 300.0  # a publisher never outlives a crashed benchmark by more than this
TICK_S = 0.005
STATS_EVERY_S = 1.0
SUBSCRIBE = b"\x01"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- measuring


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (``/proc/<pid>/stat``; no psutil needed)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank: an observed value, honest for small samples."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary(values: Sequence[float]) -> dict[str, float]:
    """The distribution the JSON details keep for every latency figure."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "min": min(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def scrape_metrics(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Every sample of a Prometheus ``/metrics`` page, keyed ``name{label=value,...}`` (labels sorted)."""
    text = httpx.get(f"http://{host}:{port}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def iso_to_epoch(stamp: str) -> float:
    """A structlog ISO timestamp (UTC, microseconds) as seconds since the epoch."""
    return datetime.fromisoformat(stamp).timestamp()


# ----------------------------------------------------------------------------- processes


def spawn(command: Sequence[str]) -> DynamoProcess:
    """Any command whose stdout is JSON lines, read into ``.events`` like a ``dynamo-prep`` process."""
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    proc = DynamoProcess(args=list(command), process=process)
    for target in (proc._read_stdout, proc._read_stderr):
        proc._readers.append(_daemon(target))
    return proc


def _daemon(target: Any) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def start_publisher(
    discovery: str,
    *,
    instances: int,
    prefix: str,
    heartbeat_s: float = 1.0,
    ttl_ms: int = 3000,
    ramp_ms: float = 0.0,
    trace: bool = False,
    max_run_s: float = MAX_RUN_S,
) -> DynamoProcess:
    """A simulated worker fleet process (see the module docstring)."""
    command = [
        sys.executable, "-m", "benchmarks._plane", "publish",
        "--discovery", discovery, "--instances", str(instances), "--prefix", prefix,
        "--heartbeat", str(heartbeat_s), "--ttl-ms", str(ttl_ms), "--ramp-ms", str(ramp_ms),
        "--max-run", str(max_run_s),
    ]  # fmt: skip
    return spawn([*command, "--trace"] if trace else command)


def start_frontend(address: str, *, cache_dir: Path, log_level: str = "info") -> DynamoProcess:
    """A real ``dynamo-prep frontend`` on the embedded plane, HTTP on a free loopback port."""
    proc = start_dynamo(
        "frontend",
        "--discovery-bind", address,
        "--http-host", "127.0.0.1", "--http-port", "0",
        "--model-path", DEMO_MODEL,
        "--cache-dir", str(cache_dir),
        log_level=log_level,
    )  # fmt: skip
    proc.wait_event("frontend_started", timeout=30)
    return proc


class FileProcess:
    """A ``dynamo-prep`` process logging to a file, not a pipe: nothing in this process reads its
    lines while it runs (a reader thread here would compete for our GIL, and a slow reader would
    stall its writes), as a container runtime collecting stdout would be."""

    def __init__(
        self, args: Sequence[str], log_path: Path, *, module: Sequence[str] = ("dynamo_prep.cli",)
    ) -> None:
        self.log_path = log_path
        with log_path.open("w") as sink:
            command = [sys.executable, "-m", *module, "--log-format", "json", *args]
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def find(self, event: str) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == event:
                    found.append(record)
        return found

    def wait_event(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise AssertionError(f"exited before {event}: {self.log_path.read_text()[-2000:]}")
            hits = self.find(event)
            return hits[0] if hits else None

        return wait_for(seen, timeout, interval=0.05, message=event)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def stop(self, timeout: float = 10.0) -> int:
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def reap(procs: Sequence[DynamoProcess | FileProcess]) -> None:
    """SIGTERM every process, then reap (SIGKILL after a bound); never raises."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.stop(timeout=10)


# ----------------------------------------------------------------------------- simulated fleet


class Fleet:
    """Many instances of one card behind one XPUB: heartbeat schedule, seqs and drop counts."""

    def __init__(self, args: argparse.Namespace) -> None:
        card = ModelDeploymentCard.from_model_dir(args.model)
        self.card = msgspec.Raw(encode_card(card))
        self.topic = topic(args.namespace)
        self.heartbeat_s = args.heartbeat
        self.ttl_ms = args.ttl_ms
        self.trace = args.trace
        self.ids = [f"{args.prefix}-{i:05d}" for i in range(args.instances)]
        self.endpoints = [f"tcp://127.0.0.1:{20000 + i}" for i in range(args.instances)]
        self.seqs = [0] * args.instances
        self.announced = [False] * args.instances
        self.stats = {"sent": 0, "dropped": 0, "subscriptions": 0, "instances": args.instances}
        now = time.monotonic()
        ramp = args.ramp_ms / 1000
        # (due, index): with a ramp, instance i starts i * ramp later (workers joining one by one);
        # without, all start now and their heartbeats keep random phases, as independent workers would.
        self.due = [(now + i * ramp, i) for i in range(args.instances)]
        heapq.heapify(self.due)
        self._phases = (
            {i: random.random() * self.heartbeat_s for i in range(args.instances)} if not ramp else {}
        )

    def open(self, discovery: Sequence[str], hwm: int) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, hwm)
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        socket.setsockopt(zmq.XPUB_NODROP, 1)  # EAGAIN instead of a silent drop: we count them
        for address in discovery:
            socket.connect(address)
        return socket

    def send(self, socket: zmq.Socket[bytes], index: int) -> None:
        self.seqs[index] += 1
        first = not self.announced[index]
        stamp = time.monotonic()
        message = Announce(
            instance_id=self.ids[index],
            seq=self.seqs[index],
            sent_ms=time.time_ns() // 1_000_000,
            ttl_ms=self.ttl_ms,
            endpoint=self.endpoints[index],
            card=self.card,
        )
        try:
            socket.send_multipart([self.topic, encode_message(message)], zmq.NOBLOCK)
        except zmq.Again:
            self.stats["dropped"] += 1
            return
        self.stats["sent"] += 1
        if first:
            self.announced[index] = True
            if self.trace:
                emit("first_announce", instance_id=self.ids[index], t=stamp, wall=time.time())

    def send_due(self, socket: zmq.Socket[bytes], now: float) -> None:
        """Every instance whose time has come; the next beat keeps the instance's own phase."""
        while self.due and self.due[0][0] <= now:
            due, index = heapq.heappop(self.due)
            self.send(socket, index)
            beat = self._phases.pop(index, self.heartbeat_s)  # first beat: the instance's own phase
            heapq.heappush(self.due, (max(due + beat, now), index))

    def reannounce(self, socket: zmq.Socket[bytes]) -> None:
        """A new subscriber: every started instance announces now, as ``CardPublisher`` does."""
        self.stats["subscriptions"] += 1
        for index, started in enumerate(self.announced):
            if started:
                self.send(socket, index)

    def withdraw_all(self, socket: zmq.Socket[bytes]) -> None:
        for index, instance_id in enumerate(self.ids):
            self.seqs[index] += 1
            message = Withdraw(instance_id=instance_id, seq=self.seqs[index], sent_ms=0)
            with contextlib.suppress(zmq.Again):
                socket.send_multipart([self.topic, encode_message(message)], zmq.NOBLOCK)


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _subscribed(socket: zmq.Socket[bytes], our_topic: bytes) -> bool:
    """Drain (un)subscriptions; True if one covers our topic."""
    found = False
    while True:
        try:
            frame = socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return found
        found = found or (frame[:1] == SUBSCRIBE and our_topic.startswith(frame[1:]))


def publish(args: argparse.Namespace) -> int:
    """Run the fleet until SIGTERM / SIGINT or ``--max-run`` seconds; withdraw on a graceful stop."""
    stopping: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda sig, frame: stopping.append(sig))
    fleet = Fleet(args)
    socket = fleet.open(args.discovery.split(","), args.hwm or max(1000, 2 * args.instances))
    end = time.monotonic() + args.max_run
    next_stats = time.monotonic() + STATS_EVERY_S
    emit("publisher_ready", instances=len(fleet.ids), pid=os.getpid())
    try:
        while not stopping and time.monotonic() < end:
            if socket.poll(int(TICK_S * 1000), zmq.POLLIN) and _subscribed(socket, fleet.topic):
                fleet.reannounce(socket)
            now = time.monotonic()
            fleet.send_due(socket, now)
            if now >= next_stats:
                emit("publisher_stats", **fleet.stats)
                next_stats = now + STATS_EVERY_S
        if args.withdraw:
            fleet.withdraw_all(socket)
    finally:
        emit("publisher_stats", final=True, **fleet.stats)
        socket.close(linger=200)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._plane")
    commands = parser.add_subparsers(dest="command", required=True)
    pub = commands.add_parser("publish", help="announce many simulated instances from one process")
    pub.add_argument("--discovery", required=True, help="ADDR[,ADDR] of the frontend's bound plane")
    pub.add_argument("--instances", type=int, required=True)
    pub.add_argument("--prefix", default=f"sim{os.getpid()}", help="instance_id prefix (unique per process)")
    pub.add_argument("--model", default=DEMO_MODEL)
    pub.add_argument("--namespace", default="dynamo")
    pub.add_argument("--heartbeat", type=float, default=1.0)
    pub.add_argument("--ttl-ms", type=int, default=3000)
    pub.add_argument("--ramp-ms", type=float, default=0.0, help="delay between instances' first announce")
    pub.add_argument(
        "--hwm", type=int, default=0, help="SNDHWM (default: 2 per instance, as N workers' own queues)"
    )
    pub.add_argument("--max-run", type=float, default=MAX_RUN_S)
    pub.add_argument("--trace", action="store_true", help="print first_announce lines")
    pub.add_argument("--withdraw", action="store_true", help="withdraw every instance on SIGTERM")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return publish(args)


@contextlib.contextmanager
def running(procs: list[DynamoProcess]) -> Iterator[list[DynamoProcess]]:
    """Collect spawned processes; all are stopped and reaped on the way out, even on failure."""
    try:
        yield procs
    finally:
        reap(procs)


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------- profiling


def start_profile(pid: int, seconds: float, output: Path) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of another process in the background (None when py-spy is not installed)."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return None
    command = [str(spy), "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "250"]
    command += ["-f", "raw", "-o", str(output), "--nonblocking"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_frames(raw: Path, limit: int = 25) -> list[tuple[float, str]]:
    """(percent of busy samples, frame) by inclusive time, from py-spy's raw (collapsed) output."""
    inclusive: Counter[str] = Counter()
    busy = 0
    for frames, count in _busy_stacks(raw):
        busy += count
        for frame in set(frames):
            inclusive[frame] += count
    return [(100 * n / max(busy, 1), frame) for frame, n in inclusive.most_common(limit)]


# Where a sample's leaf frame lives, by path fragment (first match wins): the profile's summary
# attributes self time to these parts of the stack.
_COMPONENTS = (
    ("dynamo_prep/frontend/client/", "request-plane client"),
    ("dynamo_prep/frontend/", "frontend (app, answers, records)"),
    ("dynamo_prep/parsing/", "answer parsing"),
    ("dynamo_prep/", "dynamo_prep (other)"),
    ("zmq/", "pyzmq"),
    ("uvicorn/", "uvicorn"),
    ("starlette/", "starlette"),
    ("anyio/", "anyio"),
    ("h11/", "h11"),
    ("httptools", "httptools"),
    ("granian", "granian"),
    ("structlog/", "structlog"),
    ("prometheus_client/", "prometheus_client"),
    ("msgspec", "msgspec"),
    ("tiktoken", "tiktoken"),
    ("asyncio/", "asyncio (event loop)"),
    ("uvloop", "uvloop (event loop)"),
)


def profile_summary(raw: Path, title: str, limit: int = 20) -> str:
    """A text summary of a py-spy raw profile: self time per component, then the top frames by self
    and by inclusive time (percent of busy samples; the idle ``select`` is left out)."""
    own: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    busy = 0
    for frames, count in _busy_stacks(raw):
        busy += count
        own[frames[-1]] += count
        parts[_component(frames[-1])] += count
    lines = [
        f"# {title}",
        f"busy samples: {busy}",
        "",
        "py-spy samples the main thread's wall time: a syscall that wakes another process (a socket",
        "write on loopback runs the peer's TCP receive too; a ZeroMQ send wakes its I/O thread) counts",
        "for as long as it takes, waiting for a CPU included on a saturated machine. CPU per request",
        "comes from /proc (results/http.json); read these shares as where the time goes, not the CPU.",
        "",
        "## self time by component",
    ]
    lines += [f"{100 * n / max(busy, 1):5.1f}%  {part}" for part, n in parts.most_common()]
    lines += ["", "## top frames, self time"]
    lines += [f"{100 * n / max(busy, 1):5.1f}%  {frame}" for frame, n in own.most_common(limit)]
    lines += ["", "## top frames, inclusive time"]
    lines += [f"{percent:5.1f}%  {frame}" for percent, frame in top_frames(raw, limit + 15)]
    return "\n".join(lines) + "\n"


def _component(frame: str) -> str:
    for fragment, name in _COMPONENTS:
        if fragment in frame:
            return name
    return "other (stdlib, interpreter)"


def _busy_stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or "select (selectors.py" in frames[-1]:
            continue  # a partial line, or the event loop waiting: idle, not cost
        yield frames, int(count)
