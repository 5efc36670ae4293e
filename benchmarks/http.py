"""HTTP overhead: the frontend against a direct request-plane client, on one zero-delay mock worker.

``python -m benchmarks.http [--requests 300] [--concurrency 8] [--max-tokens 16] [--rounds 3]``

A real ``dynamo-prep frontend`` (info logs, to a file) and a real ``dynamo-prep worker --token-delay 0``
run as processes.
This process sends the same chat request three ways, ``--concurrency`` at a time, interleaved in
``--rounds`` so the shared machine's noise hits every mode alike:

* direct: ``RequestPlaneClient.generate`` to the worker with the ``PreprocessedRequest`` the
  frontend would send (preprocessed here, once): the floor, the worker and ZeroMQ alone;
* HTTP non-streaming and HTTP streaming (SSE, read to ``[DONE]``) through the frontend with
  ``httpx.AsyncClient``.

The frontend's overhead = HTTP latency - direct latency (p50 and p99), and requests/s of each.
The HTTP client's own cost (httpx, in this process) is part of the HTTP figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import zmq.asyncio

from benchmarks._plane import (
    DEMO_MODEL,
    DynamoProcess,
    FileProcess,
    cpu_seconds,
    reap,
    start_profile,
    summary,
    tcp_endpoint,
    top_frames,
)
from benchmarks._report import Suite
from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.logging import configure_logging
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor, PreprocessedRequest

WARMUP = 20
TIMEOUT_S = 30.0
Send = Callable[[], Awaitable[None]]
_ids = itertools.count()


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


def http_sender(http: httpx.AsyncClient, body: dict[str, Any]) -> Send:
    async def send() -> None:
        response = await http.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    return send


def sse_sender(http: httpx.AsyncClient, body: dict[str, Any]) -> Send:
    async def send() -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return
        raise RuntimeError("stream ended without [DONE]")

    return send


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


async def measure(
    senders: dict[str, Send], args: argparse.Namespace, pids: dict[str, int]
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
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            latencies, wall, failures = await batch(senders[mode], per_round, args.concurrency)
            for name, pid in pids.items():
                pooled[mode]["cpu"][name] += cpu_seconds(pid) - before[name]
            pooled[mode]["ms"] += latencies
            pooled[mode]["wall"] += wall
            pooled[mode]["failures"] += failures
    return pooled


def report(suite: Suite, pooled: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    direct = summary(pooled["direct"]["ms"])
    for mode, data in pooled.items():
        dist = summary(data["ms"])
        rate = len(data["ms"]) / data["wall"] if data["wall"] else 0.0
        cpu_ms = {name: 1000 * seconds / max(len(data["ms"]), 1) for name, seconds in data["cpu"].items()}
        suite.details[mode] = {**dist, "requests_per_s": rate, "failures": data["failures"], "cpu_ms": cpu_ms}
        note = (
            f"p50 {dist['p50']:.2f} ms, p99 {dist['p99']:.2f} ms; {data['failures']} failed; CPU ms/req: "
            + (", ".join(f"{name} {value:.2f}" for name, value in cpu_ms.items()))
        )
        suite.record(f"{mode}: requests/s", rate, "req/s", note=note)
        if mode == "direct":
            continue
        suite.record(
            f"{mode}: frontend CPU per request",
            cpu_ms["frontend"],
            "ms",
            note=f"httpx client {cpu_ms['client']:.2f} ms; worker {cpu_ms['worker']:.2f} ms",
        )
        ratio = rate / (len(pooled["direct"]["ms"]) / pooled["direct"]["wall"])
        suite.record(
            f"{mode}: added latency p50",
            dist["p50"] - direct["p50"],
            "ms",
            note=f"HTTP - direct; throughput {ratio:.2f}x direct",
        )
        suite.record(f"{mode}: added latency p99", dist["p99"] - direct["p99"], "ms", note="HTTP - direct")
    suite.details["setup"] = {
        "requests_per_mode": len(pooled["direct"]["ms"]),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "load_average_at_start": os.getloadavg(),
    }


def preprocessed(max_tokens: int) -> PreprocessedRequest:
    """What the frontend sends the worker for the benchmark's chat request (built here, once)."""
    card = ModelDeploymentCard.from_model_dir(DEMO_MODEL)
    preprocessor = OpenAIPreprocessor.new(card, resolve_model_dir(DEMO_MODEL))
    return preprocessor.preprocess(chat_body(max_tokens, stream=False))


async def run(frontend: FileProcess, worker: FileProcess, args: argparse.Namespace) -> Suite:
    port = frontend.wait_event("frontend_started")["http_port"]
    endpoint = worker.wait_event("worker_started")["endpoint"]
    context = zmq.asyncio.Context()
    client = RequestPlaneClient(context)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=TIMEOUT_S
        ) as http:
            senders = {
                "direct": direct_sender(client, endpoint, preprocessed(args.max_tokens)),
                "http": http_sender(http, chat_body(args.max_tokens, stream=False)),
                "http stream": sse_sender(http, chat_body(args.max_tokens, stream=True)),
            }
            spy = start_profile(frontend.pid, 8, args.profile) if args.profile else None
            pids = {"frontend": frontend.pid, "worker": worker.pid, "client": os.getpid()}
            pooled = await measure(senders, args, pids)
            if spy is not None:
                await asyncio.to_thread(spy.wait, 30)
    finally:
        await client.close()
        context.destroy(linger=0)
    suite = Suite("http")
    report(suite, pooled, args)
    return suite


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http", description=__doc__)
    parser.add_argument("--requests", type=int, default=300, help="per mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the frontend into FILE (raw)")
    args = parser.parse_args()
    configure_logging(level="warning", stream=open(os.devnull, "w"))  # noqa: SIM115 - the client's own logs
    address = tcp_endpoint()
    procs: list[DynamoProcess | FileProcess] = []
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        try:
            frontend = FileProcess(
                [
                    "--log-level", "info", "frontend", "--discovery-bind", address,
                    "--http-host", "127.0.0.1", "--http-port", "0", "--model-path", DEMO_MODEL,
                    "--cache-dir", str(Path(tmp) / "cache"),
                ],
                Path(tmp) / "frontend.log",
            )  # fmt: skip
            procs.append(frontend)
            frontend.wait_event("frontend_started")
            worker = FileProcess(
                ["--log-level", "info", "worker", "--model-path", DEMO_MODEL, "--discovery", address,
                 "--token-delay", "0"],
                Path(tmp) / "worker.log",
            )  # fmt: skip
            procs.append(worker)
            frontend.wait_event("model_added")
            suite = asyncio.run(run(frontend, worker, args))
        finally:
            reap(procs)
    path = suite.write()
    print(f"wrote {path}")
    if args.profile is not None and args.profile.exists():
        for percent, frame in top_frames(args.profile):
            print(f"{percent:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
