"""HTTP overhead: the frontend against a direct request-plane client, on one zero-delay mock worker.

``python -m benchmarks.http [--requests 600] [--concurrency 8] [--rounds 3] [--profile LABEL]``
``python -m benchmarks.http --compare-stacks`` (server stacks and ``--http-workers``: suite http-stacks)

A real ``dynamo-prep frontend`` (info logs, to a file) and a real ``dynamo-prep worker --token-delay 0``
run as processes. This process sends the same chat request several ways, ``--concurrency`` at a
time, interleaved in ``--rounds`` so the shared machine's noise hits every mode alike:

* ``direct`` / ``direct 64``: ``RequestPlaneClient.generate`` to the worker with the
  ``PreprocessedRequest`` the frontend would send (built here, once), 16 / 64 tokens: the floor,
  the worker and ZeroMQ alone;
* ``http`` (16 tokens, one JSON answer), ``http stream`` (16 tokens, SSE) and ``http stream 64``
  (64 tokens, SSE) through the frontend, on keep-alive connections from ``_load.py`` (httptools'
  parser and pre-encoded requests: the client's own CPU stays small next to the frontend's).

Then *half load*: each HTTP mode paced at half its own saturated rate (open loop, fixed intervals;
latency counted from the scheduled start), and its direct counterpart at the same rate. The
frontend's added latency is HTTP - direct at that rate; CPU per request comes from
``/proc/<pid>/stat`` of each process over the saturated runs. ``--profile LABEL`` samples the
frontend with py-spy over the saturated runs and writes ``results/profile-http-LABEL.txt``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.asyncio

from benchmarks._load import Connection, HttpError, encode_post
from benchmarks._plane import (
    DEMO_MODEL,
    FileProcess,
    cpu_seconds,
    profile_summary,
    reap,
    start_profile,
    summary,
    tcp_endpoint,
    wait_for,
)
from benchmarks._report import RESULTS_DIR, Suite
from benchmarks._stack import STACKS
from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.logging import configure_logging
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessedRequest

WARMUP = 30
TIMEOUT_S = 30.0
HALF_LOAD_S = 2.0  # paced seconds per mode at half load
CHAT_PATH = "/v1/chat/completions"
Send = Callable[[], Awaitable[None]]
_ids = itertools.count()

# mode -> (max_tokens, kind); every HTTP mode is compared with the direct mode of its length.
MODES: dict[str, tuple[int, str]] = {
    "direct": (16, "direct"),
    "http": (16, "json"),
    "http stream": (16, "sse"),
    "direct 64": (64, "direct"),
    "http stream 64": (64, "sse"),
}
DIRECT_OF = {"http": "direct", "http stream": "direct", "http stream 64": "direct 64"}
# The targets: CPU per request, throughput against direct, added p50 at half load.
CPU_TARGET_MS = {"http": 1.0, "http stream 64": 1.5}
RATIO_TARGET = 0.8
HALF_LOAD_TARGET_MS = 5.0


def chat_body(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": DEMO_MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello to the benchmark, in a few words."},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def direct_sender(client: RequestPlaneClient, endpoint: str, request: PreprocessedRequest) -> Send:
    async def send() -> None:
        steps = client.generate(endpoint, request, request_id=f"bench-{next(_ids)}", timeout_s=TIMEOUT_S)
        async for output in steps:
            if output.finish_reason is not None:
                return
        raise RuntimeError("stream ended without a finish reason")

    return send


class HttpSender:
    """Requests over a pool of keep-alive connections (one per request in flight)."""

    def __init__(self, port: int, raw: bytes, *, stream: bool) -> None:
        self.port = port
        self.raw = raw
        self.stream = stream
        self._idle: list[Connection] = []

    async def __call__(self) -> None:
        reused = None
        while self._idle:  # the server closes connections idle past its keep-alive
            candidate = self._idle.pop()
            if candidate.open_:
                reused = candidate
                break
        try:
            connection = reused or await Connection.open("127.0.0.1", self.port)
            body = await connection.request(self.raw)
        except HttpError as exc:
            if reused is None or "connection lost" not in str(exc):
                raise
            # closed by its keep-alive timeout as the request went out: it never arrived
            connection = await Connection.open("127.0.0.1", self.port)
            body = await connection.request(self.raw)
        if self.stream and not body.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"stream ended without [DONE]: {body[-200:]!r}")
        if not self.stream and b'"finish_reason"' not in body:
            raise RuntimeError(f"no answer: {body[:200]!r}")
        self._idle.append(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()


async def batch(send: Send, count: int, concurrency: int) -> tuple[list[float], float, int]:
    """``count`` requests, ``concurrency`` in flight: (latencies in ms, wall seconds, failures)."""
    latencies: list[float] = []
    failures = 0
    todo = iter(range(count))

    async def lane() -> None:
        nonlocal failures
        for _ in todo:
            started = time.perf_counter()
            try:
                await send()
            except Exception:  # counted and reported; one failure must not stop the run
                failures += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)

    began = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return latencies, time.perf_counter() - began, failures


async def paced(send: Send, rate: float, seconds: float) -> tuple[list[float], int]:
    """Open loop: one request every ``1 / rate`` s for ``seconds``; latency from its scheduled start."""
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    failures = 0
    count = max(1, round(rate * seconds))
    start = loop.time() + 0.05

    async def one(due: float) -> None:
        nonlocal failures
        await asyncio.sleep(max(due - loop.time(), 0))  # the schedule itself, not a synchronisation
        try:
            await send()
        except Exception:
            failures += 1
            return
        latencies.append((loop.time() - due) * 1000)

    await asyncio.gather(*(one(start + i / rate) for i in range(count)))
    return latencies, failures


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


async def measure(
    senders: dict[str, Send], args: argparse.Namespace, pids: dict[str, list[int]]
) -> dict[str, dict[str, Any]]:
    """Warm every mode up, then interleave rounds (rotating the order) and pool the samples.

    Also each process's CPU seconds per mode: on a shared, noisy machine, CPU per request is
    steadier than latency."""
    for send in senders.values():
        await batch(send, WARMUP, args.concurrency)
    pooled: dict[str, dict[str, Any]] = {
        mode: {"ms": [], "wall": 0.0, "failures": 0, "cpu": dict.fromkeys(pids, 0.0)} for mode in senders
    }
    per_round = max(1, args.requests // args.rounds)
    modes = list(senders)
    for round_index in range(args.rounds):
        for mode in modes[round_index % len(modes) :] + modes[: round_index % len(modes)]:
            before = {name: _cpu(group) for name, group in pids.items()}
            latencies, wall, failures = await batch(senders[mode], per_round, args.concurrency)
            for name, group in pids.items():
                pooled[mode]["cpu"][name] += _cpu(group) - before[name]
            pooled[mode]["ms"] += latencies
            pooled[mode]["wall"] += wall
            pooled[mode]["failures"] += failures
    return pooled


async def half_load(
    senders: dict[str, Send], pooled: dict[str, dict[str, Any]], frontends: Iterable[Frontend]
) -> dict[str, Any]:
    """Each HTTP mode and its direct counterpart, paced at half the HTTP mode's saturated rate."""
    results: dict[str, Any] = {}
    pairs = [(spec.mode(mode), direct) for spec in frontends for mode, direct in DIRECT_OF.items()]
    for mode, direct in pairs:
        if mode not in senders:
            continue
        rate = 0.5 * len(pooled[mode]["ms"]) / pooled[mode]["wall"]
        direct_ms, direct_failures = await paced(senders[direct], rate, HALF_LOAD_S)
        http_ms, http_failures = await paced(senders[mode], rate, HALF_LOAD_S)
        results[mode] = {
            "rate": rate,
            "http": summary(http_ms),
            "direct": summary(direct_ms),
            "failures": http_failures + direct_failures,
        }
    return results


def report(
    suite: Suite, pooled: dict[str, dict[str, Any]], half: dict[str, Any], args: argparse.Namespace
) -> None:
    rates = {mode: len(data["ms"]) / data["wall"] if data["wall"] else 0.0 for mode, data in pooled.items()}
    for mode, data in pooled.items():
        dist = summary(data["ms"])
        cpu_ms = {name: 1000 * seconds / max(len(data["ms"]), 1) for name, seconds in data["cpu"].items()}
        suite.details[mode] = {
            **dist,
            "requests_per_s": rates[mode],
            "failures": data["failures"],
            "cpu_ms": cpu_ms,
        }
        note = (
            f"p50 {dist['p50']:.2f} ms, p99 {dist['p99']:.2f} ms; {data['failures']} failed; CPU ms/req: "
            + (", ".join(f"{name} {value:.2f}" for name, value in cpu_ms.items()))
        )
        suite.record(f"{mode}: requests/s", rates[mode], "req/s", note=note)
        if mode not in DIRECT_OF:
            continue
        target = CPU_TARGET_MS.get(mode)
        suite.record(
            f"{mode}: frontend CPU per request",
            cpu_ms["frontend"],
            "ms",
            target=f"<= {target} ms" if target else "",
            met=cpu_ms["frontend"] <= target if target else None,
            note=f"load client {cpu_ms['client']:.2f} ms; worker {cpu_ms['worker']:.2f} ms",
        )
        ratio = rates[mode] / rates[DIRECT_OF[mode]]
        targeted = mode in CPU_TARGET_MS
        suite.record(
            f"{mode}: throughput / {DIRECT_OF[mode]}",
            ratio,
            "x",
            target=f">= {RATIO_TARGET}x" if targeted else "",
            met=ratio >= RATIO_TARGET if targeted else None,
            note=f"saturated, {args.concurrency} in flight; added p50 "
            f"{dist['p50'] - summary(pooled[DIRECT_OF[mode]]['ms'])['p50']:.2f} ms",
        )
        load = half[mode]
        added_p50 = load["http"]["p50"] - load["direct"]["p50"]
        suite.record(
            f"{mode}: added latency p50 at half load",
            added_p50,
            "ms",
            target=f"<= {HALF_LOAD_TARGET_MS} ms" if targeted else "",
            met=added_p50 <= HALF_LOAD_TARGET_MS if targeted else None,
            note=f"{load['rate']:.0f} req/s; p99 added {load['http']['p99'] - load['direct']['p99']:.2f} ms; "
            f"direct p50 {load['direct']['p50']:.2f} ms; {load['failures']} failed",
        )
    suite.details["half_load"] = half
    suite.details["setup"] = {
        "requests_per_mode": len(pooled["direct"]["ms"]),
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "stack": args.stack,
        "http_workers": args.http_workers,
        "load_average_at_start": os.getloadavg(),
    }


def preprocessed(max_tokens: int) -> PreprocessedRequest:
    """What the frontend sends the worker for the benchmark's chat request (built here, once)."""
    card = ModelDeploymentCard.from_model_dir(DEMO_MODEL)
    preprocessor = OpenAIPreprocessor.new(card, resolve_model_dir(DEMO_MODEL))
    return preprocessor.preprocess(chat_body(max_tokens, stream=False))


@dataclass(frozen=True)
class Frontend:
    """One frontend under test: its label in mode names ("" alone), server stack, HTTP processes."""

    label: str
    stack: str
    http_workers: int = 1

    def mode(self, mode: str) -> str:
        return f"{self.label} / {mode}" if self.label else mode

    @property
    def cpu_key(self) -> str:
        return self.label or "frontend"


async def run(
    frontends: dict[Frontend, FileProcess], worker: FileProcess, args: argparse.Namespace
) -> dict[str, Any]:
    endpoint = worker.wait_event("worker_started")["endpoint"]
    context = zmq.asyncio.Context()
    client = RequestPlaneClient(context)
    senders: dict[str, Send] = {}
    pids = {"worker": [worker.pid], "client": [os.getpid()]}
    ports = {spec: proc.wait_event("frontend_started")["http_port"] for spec, proc in frontends.items()}
    for spec, proc in frontends.items():
        pids[spec.cpu_key] = [proc.pid, *(event["pid"] for event in proc.find("http_worker_started"))]
    for mode, (tokens, kind) in MODES.items():
        if kind == "direct":
            senders[mode] = direct_sender(client, endpoint, preprocessed(tokens))
            continue
        raw = encode_post(CHAT_PATH, chat_body(tokens, stream=kind == "sse"))
        for spec in frontends if mode in args.modes else ():
            senders[spec.mode(mode)] = HttpSender(ports[spec], raw, stream=kind == "sse")
    profiled = next(iter(frontends.values()))
    try:
        raw_profile = Path(tempfile.gettempdir()) / f"http-profile-{os.getpid()}.raw"
        spy = start_profile(profiled.pid, args.profile_seconds, raw_profile) if args.profile else None
        pooled = await measure(senders, args, pids)
        if spy is not None:
            await asyncio.to_thread(spy.wait, 60)
            _write_profile(raw_profile, args.profile)
        half = await half_load(senders, pooled, frontends)
    finally:
        for send in senders.values():
            if isinstance(send, HttpSender):
                send.close()
        await client.close()
        context.destroy(linger=0)
    return {"pooled": pooled, "half": half}


def _write_profile(raw: Path, label: str) -> None:
    if not raw.exists():
        print("py-spy wrote no profile (is it installed, may it ptrace?)")
        return
    path = RESULTS_DIR / f"profile-http-{label}.txt"
    path.write_text(profile_summary(raw, f"frontend profile, benchmarks.http ({label})"), encoding="utf-8")
    print(f"wrote {path} (raw samples: {raw})")


def serve_and_measure(args: argparse.Namespace, specs: list[Frontend]) -> dict[str, Any]:
    """Start one worker and the frontends of ``specs`` (each its own plane), measure, stop them."""
    procs: list[FileProcess] = []
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        try:
            addresses = []
            frontends: dict[Frontend, FileProcess] = {}
            for index, spec in enumerate(specs):
                address = tcp_endpoint()
                frontend = FileProcess(
                    [
                        "--log-level", "info", "frontend", "--discovery-bind", address,
                        "--http-host", "127.0.0.1", "--http-port", "0", "--model-path", DEMO_MODEL,
                        "--cache-dir", str(Path(tmp) / f"cache-{index}"),
                        *(["--http-workers", str(spec.http_workers)] if spec.http_workers > 1 else []),
                    ],
                    Path(tmp) / f"frontend-{index}.log",
                    module=("benchmarks._stack", spec.stack),
                )  # fmt: skip
                procs.append(frontend)
                frontend.wait_event("frontend_started")
                frontends[spec] = frontend
                addresses.append(address)
            worker = FileProcess(
                ["--log-level", "info", "worker", "--model-path", DEMO_MODEL,
                 "--discovery", ",".join(addresses), "--token-delay", "0"],
                Path(tmp) / "worker.log",
            )  # fmt: skip
            procs.append(worker)
            for spec, frontend in frontends.items():
                wait_for(
                    lambda f=frontend, n=spec.http_workers: len(f.find("model_added")) >= n,
                    30,
                    message="model_added",
                )
            return asyncio.run(run(frontends, worker, args))
        finally:
            reap(procs)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http", description=__doc__)
    parser.add_argument("--requests", type=int, default=600, help="per mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stack", choices=STACKS, default=STACKS[0])
    parser.add_argument("--http-workers", type=int, default=1)
    parser.add_argument("--profile", default=None, metavar="LABEL", help="py-spy the frontend")
    parser.add_argument("--profile-seconds", type=float, default=12.0)
    parser.add_argument("--compare-stacks", action="store_true", help="every stack, and 2 HTTP workers")
    parser.add_argument("--suite", default="http", help="the results' name (e.g. http-before)")
    args = parser.parse_args()
    configure_logging(level="warning", stream=open(os.devnull, "w"))  # noqa: SIM115 - the client's own logs
    if args.compare_stacks:
        return compare_stacks(args)
    args.modes = list(MODES)
    measured = serve_and_measure(args, [Frontend("", args.stack, args.http_workers)])
    suite = Suite(args.suite)
    report(suite, measured["pooled"], measured["half"], args)
    print(f"wrote {suite.write()}")
    return 0


def compare_stacks(args: argparse.Namespace) -> int:
    """The figures that chose the stack: a frontend per server stack (and one with 2 HTTP
    processes), all against the same worker, their modes interleaved in the same rounds."""
    suite = Suite("http-stacks")
    specs = [Frontend(stack, stack) for stack in STACKS]
    specs.append(Frontend(f"{STACKS[0]}, --http-workers 2", STACKS[0], 2))
    args.modes = ["http", "http stream 64"]
    measured = serve_and_measure(args, specs)
    pooled, half = measured["pooled"], measured["half"]
    for spec in specs:
        for mode in args.modes:
            data = pooled[spec.mode(mode)]
            cpu = 1000 * data["cpu"][spec.cpu_key] / max(len(data["ms"]), 1)
            direct = pooled[DIRECT_OF[mode]]
            rate = len(data["ms"]) / data["wall"]
            ratio = rate / (len(direct["ms"]) / direct["wall"])
            load = half[spec.mode(mode)]
            added = load["http"]["p50"] - load["direct"]["p50"]
            suite.record(
                f"{spec.mode(mode)}: frontend CPU per request",
                cpu,
                "ms",
                note=f"{rate:.0f} req/s, {ratio:.2f}x {DIRECT_OF[mode]}; "
                f"added p50 at half load {added:.2f} ms; {data['failures']} failed",
            )
    suite.details = {"half_load": half, "setup": {"requests_per_mode": args.requests, "rounds": args.rounds}}
    print(f"wrote {suite.write()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
