"""Soak: mixed traffic against a frontend whose workers keep joining and leaving.

``python -m benchmarks.soak [--minutes 10]`` (``make soak``) starts a real ``dynamo-prep frontend``
and ``--workers`` mock workers (flavors alternate sglang / vllm, so every kill leaves an instance
with the same declaration to migrate to), and for the whole run:

* sends ``--rate`` requests/s (default 20) of a seeded mix: non-streaming, streaming, with images,
  client-side cancellations (the stream is closed after two chunks), bad requests (400/404
  expected), and ``/v1/models``;
* restarts one worker every ``--restart-every`` seconds, in turn, with SIGTERM (graceful: withdraw,
  drain) or, every third time, SIGKILL (the frontend only learns it from the TTL);
* samples the frontend's RSS, open file descriptors and sockets (``/proc/<pid>``) every few seconds.

It reports the RSS slope after warm-up (least squares, KB/min), descriptors at start (after a
warm-up that opened every worker's request-plane channel, no client connected) and at the end
(traffic over, once they are back to the start's count or ``DEFAULT_IDLE_CLOSE_S`` + 10 s have
passed: a retired worker's channel may stay open that long), the outcome histogram, and the
frontend's own account (migrations, reroutes, losses). Success means: zero 5xx other than a 503
that says no instance was live, no transport error, every bad request refused with a 4xx, and no
descriptor growth. The asyncio task count is not reported: the frontend exposes no metric for it.
Results go through ``benchmarks/_report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._images import PNG_DATA_URL
from benchmarks._report import Suite
from dynamo_prep.engines.registry import FLAVORS
from dynamo_prep.frontend.client import DEFAULT_IDLE_CLOSE_S

DEMO = "kimi-k3-demo"
IMAGE = {"type": "image_url", "image_url": {"url": PNG_DATA_URL}}  # a real picture: workers decode it
WORKER_OPTIONS = (
    "--token-delay", "0.01", "--heartbeat", "0.5", "--ttl-ms", "2000",
    "--migration-limit", "1", "--drain-timeout", "5",
)  # fmt: skip
SAMPLE_EVERY_S = 5.0
MAX_IN_FLIGHT = 64
START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 15.0
REQUEST_TIMEOUT_S = 30.0
IDLE_WAIT_S = DEFAULT_IDLE_CLOSE_S + 10
FD_TOLERANCE = 2  # a reconnecting TCP socket may be counted in one sample and not the other
RSS_SLOPE_TARGET_KB_MIN = 256.0
NO_INSTANCE = ("no live instance", "no model is being served")
# (kind, weight) of the traffic mix.
MIX = (
    ("plain", 30),
    ("stream", 25),
    ("image", 15),
    ("cancel", 15),
    ("bad", 10),
    ("models", 5),
)


# -- processes ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Child:
    """A ``dynamo-prep`` subprocess logging JSON lines to its own file."""

    name: str
    flavor: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict):
                    out.append(event)
        return out


class Cluster:
    """The frontend and its workers, with logs under ``workdir``."""

    def __init__(self, workdir: Path, workers: int) -> None:
        self.workdir = workdir
        self.http_port = free_port()
        self.discovery = f"tcp://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.frontend: Child | None = None
        self.workers: list[Child] = []
        self.retired: list[Child] = []
        self._count = workers
        self._started = 0

    def start(self) -> None:
        self.frontend = self._spawn(
            "frontend",
            "",
            "frontend", "--discovery-bind", self.discovery, "--http-host", "127.0.0.1",
            "--http-port", str(self.http_port), "--cache-dir", str(self.workdir / "cache"),
        )  # fmt: skip
        self.workers = [self.start_worker(FLAVORS[index % len(FLAVORS)]) for index in range(self._count)]

    def start_worker(self, flavor: str) -> Child:
        self._started += 1
        return self._spawn(
            f"worker-{self._started}",
            flavor,
            "worker", "--model-path", DEMO, "--flavor", flavor, "--discovery", self.discovery,
            *WORKER_OPTIONS,
        )  # fmt: skip

    async def restart(self, index: int, sig: signal.Signals) -> None:
        """Stop worker ``index`` with ``sig``, wait for it to exit, start one of the same flavor."""
        old = self.workers[index]
        old.process.send_signal(sig)
        await _exited(old.process, EXIT_TIMEOUT_S)
        self.retired.append(old)
        self.workers[index] = self.start_worker(old.flavor)

    def stop(self) -> None:
        children = [*self.workers, *([self.frontend] if self.frontend else [])]
        for child in children:
            if child.process.poll() is None:
                child.process.terminate()
        for child in children:
            try:
                child.process.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()

    def _spawn(self, name: str, flavor: str, *args: str) -> Child:
        log_path = self.workdir / f"{name}.log"
        command = [sys.executable, "-m", "dynamo_prep.cli", "--log-level", "info", "--log-format", "json"]
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [*command, *args],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return Child(name, flavor, process, log_path)


async def _exited(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            return
        await asyncio.sleep(0.05)  # polling the exit status, bounded by the deadline


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.1)  # condition polling interval


# -- /proc sampling ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_kb: int
    fds: int
    sockets: int
    threads: int


def sample(pid: int, at_s: float) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    fds = sockets = 0
    for entry in os.scandir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # an fd closed while we list them
            fds += 1
            sockets += os.readlink(entry.path).startswith("socket:")
    return Sample(
        at_s=at_s,
        rss_kb=int(fields["VmRSS"].split()[0]),
        fds=fds,
        sockets=sockets,
        threads=int(fields["Threads"]),
    )


async def settled_sample(pid: int, at_s: float, timeout_s: float = 10.0) -> Sample:
    """A sample once the descriptor counts stop moving (two equal reads 0.5 s apart), or the last one."""
    previous = sample(pid, at_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # spacing between two reads of the same counters
        current = sample(pid, at_s)
        if (current.fds, current.sockets) == (previous.fds, previous.sockets):
            return current
        previous = current
    return previous


async def back_to(pid: int, start: Sample, t0: float, timeout_s: float) -> Sample:
    """The first sample whose descriptors are back to ``start``'s (within the tolerance), or the last
    one at the deadline. Request-plane channels close after ``DEFAULT_IDLE_CLOSE_S`` without use, so a
    retired worker's channel may legitimately stay open that long; past it, what is left leaked."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = sample(pid, time.monotonic() - t0)
        flat = current.fds <= start.fds + FD_TOLERANCE and current.sockets <= start.sockets + FD_TOLERANCE
        if flat or time.monotonic() > deadline:
            return current
        await asyncio.sleep(1.0)  # polling interval of the condition


def slope_kb_per_min(samples: list[Sample]) -> float | None:
    if len(samples) < 3:
        return None
    xs = [s.at_s / 60 for s in samples]
    ys = [float(s.rss_kb) for s in samples]
    return statistics.linear_regression(xs, ys).slope


# -- traffic -----------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes by label, latencies of successes by kind, and what counts as a failure."""

    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=dict)

    def ok(self, kind: str, started: float) -> None:
        self.outcomes[f"{kind}:ok"] += 1
        self.latencies.setdefault(kind, []).append(time.perf_counter() - started)

    def add(self, label: str, *, failure: str | None = None) -> None:
        self.outcomes[label] += 1
        if failure is not None and len(self.failures) < 50:
            self.failures.append(failure)
        if failure is not None:
            self.outcomes["FAILURES"] += 1


def chat_body(rng: random.Random, index: int, *, images: int = 0, stream: bool = False) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [IMAGE] * images
    parts.append({"type": "text", "text": f"soak request {index} " + "x" * rng.randrange(0, 200)})
    return {"model": DEMO, "messages": [{"role": "user", "content": parts}], "stream": stream}


BAD_BODIES: tuple[Callable[[], bytes], ...] = (
    lambda: json.dumps(
        {"model": DEMO, "messages": [{"role": "user", "content": [{"type": "video"}]}]}
    ).encode(),
    lambda: json.dumps(
        {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}
    ).encode(),
    lambda: b"{not json",
    lambda: json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
)


class Traffic:
    """Issues one request of the seeded mix at a time, classifying its outcome into a ``Tally``."""

    def __init__(self, client: httpx.AsyncClient, url: str, seed: int) -> None:
        self.client = client
        self.url = url
        self.rng = random.Random(seed)
        self.tally = Tally()
        kinds, weights = zip(*MIX, strict=True)
        self._kinds: tuple[str, ...] = kinds
        self._weights: tuple[int, ...] = weights

    async def one(self, index: int) -> None:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        started = time.perf_counter()
        try:
            await self._dispatch(kind, index, started)
        except httpx.HTTPError as exc:
            self.tally.add(f"{kind}:transport_error", failure=f"{kind} #{index}: {exc!r}")

    async def _dispatch(self, kind: str, index: int, started: float) -> None:
        match kind:
            case "plain":
                await self._complete(kind, chat_body(self.rng, index), started)
            case "image":
                body = chat_body(self.rng, index, images=self.rng.randint(1, 2), stream=index % 2 == 0)
                await (
                    self._stream(kind, body, started)
                    if body["stream"]
                    else self._complete(kind, body, started)
                )
            case "stream":
                await self._stream(kind, chat_body(self.rng, index, stream=True), started)
            case "cancel":
                await self._stream(kind, chat_body(self.rng, index, stream=True), started, stop_after=2)
            case "bad":
                await self._bad(self.rng.choice(BAD_BODIES)(), index)
            case "models":
                response = await self.client.get(f"{self.url}/v1/models")
                self._status(kind, response.status_code, response.text, started)

    async def _complete(self, kind: str, body: dict[str, Any], started: float) -> None:
        response = await self.client.post(f"{self.url}/v1/chat/completions", json=body)
        self._status(kind, response.status_code, response.text, started)

    async def _stream(self, kind: str, body: dict[str, Any], started: float, *, stop_after: int = 0) -> None:
        async with self.client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                self._status(kind, response.status_code, (await response.aread()).decode(), started)
                return
            chunks = 0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    self.tally.ok(kind, started)
                    return
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self._stream_error(kind, event["error"])
                    return
                chunks += 1
                if stop_after and chunks > stop_after:  # the role chunk, then stop_after pieces
                    self.tally.add(f"{kind}:cancelled")
                    return  # leaving the block closes the connection: the frontend cancels
        self.tally.add(f"{kind}:truncated", failure=f"{kind}: stream ended without [DONE]")

    async def _bad(self, payload: bytes, index: int) -> None:
        response = await self.client.post(
            f"{self.url}/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
        )
        code = response.status_code
        if 400 <= code < 500:
            self.tally.add(f"bad:{code}")
        else:
            self.tally.add(f"bad:{code}", failure=f"bad request #{index} got {code}: {response.text[:200]}")

    def _status(self, kind: str, code: int, text: str, started: float) -> None:
        if code == 200:
            self.tally.ok(kind, started)
        elif code == 503 and any(reason in text for reason in NO_INSTANCE):
            self.tally.add(f"{kind}:503_no_instance")
        else:
            self.tally.add(f"{kind}:{code}", failure=f"{kind} got {code}: {text[:300]}")

    def _stream_error(self, kind: str, error: dict[str, Any]) -> None:
        code, message = error.get("code"), str(error.get("message"))
        if code == 503 and any(reason in message for reason in NO_INSTANCE):
            self.tally.add(f"{kind}:stream_503_no_instance")
        else:
            self.tally.add(f"{kind}:stream_error_{code}", failure=f"{kind} stream error {code}: {message}")


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class Options:
    minutes: float
    rate: float
    workers: int
    restart_every_s: float
    seed: int
    keep_logs: bool


async def run(options: Options, workdir: Path) -> tuple[Suite, bool]:
    cluster = Cluster(workdir, options.workers)
    cluster.start()
    try:
        return await _soak(cluster, options)
    finally:
        cluster.stop()


async def _soak(cluster: Cluster, options: Options) -> tuple[Suite, bool]:
    assert cluster.frontend is not None
    pid = cluster.frontend.process.pid
    await _ready(cluster)
    start = await _warm(cluster, pid, options)
    t0 = time.monotonic()  # sample times count from the start sample (taken after the warm-up)
    duration_s = options.minutes * 60
    samples: list[Sample] = [start]
    restarts: list[tuple[float, str, str]] = []
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S, limits=_limits()) as client:
        traffic = Traffic(client, cluster.url, options.seed)
        ends_at = time.monotonic() + duration_s
        background = [
            asyncio.create_task(_sampler(pid, t0, samples, ends_at)),
            asyncio.create_task(_churn(cluster, options, restarts, t0, ends_at)),
        ]
        skipped = await _drive(traffic, options.rate, ends_at)
        await asyncio.gather(*background)
    busy = await settled_sample(pid, time.monotonic() - t0)
    print(f"soak: traffic done; waiting up to {IDLE_WAIT_S:g}s for descriptors to come back", flush=True)
    end = await back_to(pid, start, t0, IDLE_WAIT_S)
    print(f"soak: traffic done, {sum(traffic.tally.outcomes.values())} outcomes", flush=True)
    return _report(cluster, options, Outcome(traffic.tally, samples, start, busy, end, restarts, skipped))


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=16)


async def _ready(cluster: Cluster) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:

        async def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await client.get(f"{cluster.url}/health")).status_code == 200
            return False

        await _until(healthy, START_TIMEOUT_S, "the frontend to serve a model")

    async def all_live() -> bool:
        assert cluster.frontend is not None
        events = cluster.frontend.events()
        added = {e["instance_id"] for e in events if e.get("event") == "instance_added"}
        return len(added) >= len(cluster.workers)

    await _until(all_live, START_TIMEOUT_S, "every worker instance")


async def _warm(cluster: Cluster, pid: int, options: Options) -> Sample:
    """A few requests per worker (opens every request-plane channel), then the start sample."""
    async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
        traffic = Traffic(client, cluster.url, options.seed + 1)
        for index in range(4 * options.workers):
            await traffic._complete("warm", chat_body(traffic.rng, index), time.perf_counter())
        if traffic.tally.failures:
            raise RuntimeError(f"warm-up failed: {traffic.tally.failures[:3]}")
    return await settled_sample(pid, 0.0)


async def _drive(traffic: Traffic, rate: float, ends_at: float) -> int:
    """Start one request every 1/rate seconds (at most MAX_IN_FLIGHT open); returns how many were skipped."""
    loop = asyncio.get_running_loop()
    begin = loop.time()
    in_flight: set[asyncio.Task[None]] = set()
    skipped = 0
    index = 0
    while time.monotonic() < ends_at:
        index += 1
        delay = begin + index / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the request schedule (rate limit), not a synchronisation
        if len(in_flight) >= MAX_IN_FLIGHT:
            skipped += 1
            continue
        task = asyncio.create_task(traffic.one(index))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.wait(in_flight, timeout=REQUEST_TIMEOUT_S + 5)
    return skipped


async def _sampler(pid: int, t0: float, samples: list[Sample], ends_at: float) -> None:
    while time.monotonic() < ends_at:
        await asyncio.sleep(SAMPLE_EVERY_S)  # the sampling period
        with contextlib.suppress(OSError):
            samples.append(sample(pid, time.monotonic() - t0))


async def _churn(
    cluster: Cluster, options: Options, restarts: list[tuple[float, str, str]], t0: float, ends_at: float
) -> None:
    """Restart worker n % workers every restart period: SIGKILL every third time, else SIGTERM."""
    turn = 0
    while time.monotonic() + options.restart_every_s < ends_at:
        await asyncio.sleep(options.restart_every_s)  # the churn period
        sig = signal.SIGKILL if turn % 3 == 2 else signal.SIGTERM
        index = turn % len(cluster.workers)
        restarts.append((round(time.monotonic() - t0, 1), cluster.workers[index].flavor, sig.name))
        print(
            f"soak: t={restarts[-1][0]}s restarting a {cluster.workers[index].flavor} worker with {sig.name}"
        )
        await cluster.restart(index, sig)
        turn += 1


# -- report ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Everything one run measured, for the report."""

    tally: Tally
    samples: list[Sample]
    start: Sample
    busy: Sample  # right after the traffic
    end: Sample
    restarts: list[tuple[float, str, str]]
    skipped: int


FRONTEND_EVENTS = (
    "instance_added",
    "instance_removed",
    "model_added",
    "model_removed",
    "request_migrated",
    "request_rerouted",
    "worker_lost",
    "worker_stalled",
    "stream_failed",
    "request_failed",
    "request_crashed",
    "client_disconnected",
    "frontend_component_failed",
)


def _report(cluster: Cluster, options: Options, run: Outcome) -> tuple[Suite, bool]:
    suite = Suite("soak")
    warmup_s = min(60.0, options.minutes * 60 / 4)
    steady = [s for s in run.samples if s.at_s >= warmup_s]
    slope = slope_kb_per_min(steady)
    outcomes = run.tally.outcomes
    failures = outcomes["FAILURES"]
    fd_growth = run.end.fds - run.start.fds
    socket_growth = run.end.sockets - run.start.sockets
    checks = {
        "no 5xx except 503 with no live instance, no transport error": failures == 0,
        "descriptors flat": fd_growth <= FD_TOLERANCE and socket_growth <= FD_TOLERANCE,
        "rss flat": slope is not None and slope <= RSS_SLOPE_TARGET_KB_MIN,
    }
    total = sum(count for label, count in outcomes.items() if label != "FAILURES")
    shape = f"{options.minutes:g} min, {options.rate:g} req/s, {options.workers} workers"
    suite.record("requests", total, "", note=f"{shape}, {len(run.restarts)} restarts")
    suite.record("failures (5xx but 503 no-instance, transport, stream)", failures, "", target="0",
                 met=failures == 0)  # fmt: skip
    suite.record("frontend RSS slope after warm-up", slope, "KB/min",
                 target=f"<= {RSS_SLOPE_TARGET_KB_MIN:g}", met=checks["rss flat"],
                 note=f"{len(steady)} samples from t={warmup_s:g}s")  # fmt: skip
    late = slope_kb_per_min(steady[len(steady) // 2 :])
    suite.record("frontend RSS slope, second half", late, "KB/min", note="plateauing if well below the slope")
    suite.record("frontend RSS start -> end", run.end.rss_kb - run.start.rss_kb, "KB",
                 note=f"{run.start.rss_kb} -> {run.end.rss_kb} KB")  # fmt: skip
    suite.record("frontend fds growth", fd_growth, "", target=f"<= {FD_TOLERANCE}",
                 met=fd_growth <= FD_TOLERANCE, note=f"{run.start.fds} -> {run.end.fds}")  # fmt: skip
    suite.record("frontend sockets growth", socket_growth, "", target=f"<= {FD_TOLERANCE}",
                 met=socket_growth <= FD_TOLERANCE,
                 note=f"{run.start.sockets} -> {run.end.sockets}")  # fmt: skip
    for kind, values in sorted(run.tally.latencies.items()):
        if len(values) >= 20:
            cuts = statistics.quantiles(values, n=100)
            suite.record(f"{kind} latency p50", cuts[49] * 1000, "ms", note=f"p99 {cuts[98] * 1000:.0f} ms")
    events = Counter(e.get("event") for e in cluster.frontend.events()) if cluster.frontend else Counter()
    suite.details = {
        "options": vars(options),
        "outcomes": dict(sorted(outcomes.items())),
        "failures": run.tally.failures,
        "skipped_at_client_limit": run.skipped,
        "restarts": run.restarts,
        "samples": [vars(s) for s in run.samples],
        "start": vars(run.start),
        "after_traffic": vars(run.busy),
        "end": vars(run.end),
        "checks": checks,
        "frontend_events": {name: events[name] for name in FRONTEND_EVENTS},
        "tasks": "not exposed by the frontend (no metric); skipped",
    }
    return suite, all(checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--workers", type=int, default=4, help="mock workers (flavors alternate)")
    parser.add_argument("--restart-every", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the process logs (path printed)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.workers < 2 or args.restart_every <= 0:
        parser.error("--minutes, --rate, --restart-every must be positive and --workers at least 2")
    options = Options(args.minutes, args.rate, args.workers, args.restart_every, args.seed, args.keep_logs)
    workdir = Path(tempfile.mkdtemp(prefix="dynamo-prep-soak-"))
    suite, passed = asyncio.run(run(options, workdir))
    path = suite.write()
    print(json.dumps({k: suite.details[k] for k in ("outcomes", "frontend_events", "checks")}, indent=1))
    for failure in suite.details["failures"][:10]:
        print(f"FAILURE: {failure}")
    if passed and not options.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
        workdir = Path("(removed; --keep-logs keeps them)")
    print(f"soak: {'PASSED' if passed else 'FAILED'}; results in {path}; logs in {workdir}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
