"""Streams side by side: frontend + ``dynamo-prep worker --engine vllm`` against ``vllm serve``.

``python -m benchmarks.stream_events [--rounds 2] [--requests 32] [--tokens 128]
[--concurrency 1,8,32]`` (``make bench-stream``: the engines' venv, vLLM's CPU build). Both stacks
run the same engine flags on the same tiny dummy-weight model (its tokenizer as ``tokenizer.json``,
so ``vllm serve`` can render chats too) at the same time; one client process streams the same
chats (``ignore_eos``, greedy) through one stack then the other, the order alternating round by
round, and reads every SSE event as it arrives (httptools, keep-alive connections).

Per concurrency, ours / vLLM's in one run: output tokens/s, TTFT p50 and p99 (to the first event
with text), inter-event latency p50 (what ``vllm bench serve`` calls ITL: one per event), events
per stream, streams whose first text came after half their time, and the CPU per output token
outside the engine (ours: the frontend and the worker's process; vLLM's: its API server process;
the engine core processes are not counted either way). Stalls are the frontend's and the worker's
own ``event_loop_stalled`` lines (over 100 ms, with their cause). The load average is recorded:
the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httptools

from benchmarks._plane import FileProcess, cpu_seconds, percentile, tcp_endpoint
from benchmarks._report import Suite

REPO = Path(__file__).resolve().parent.parent
MODEL = "engmodel"
FLAGS = (
    "--load-format", "dummy", "--gpu-memory-utilization", "0.05", "--block-size", "32",
    "--max-num-seqs", "32", "--seed", "0",
)  # fmt: skip
START_S = 600.0
WORDS = ("sea", "wind", "boat", "harbour", "sail", "rope", "tide", "gull", "fish", "net", "salt", "storm")


# ----------------------------------------------------------------------------- client process


class _Stream(asyncio.Protocol):
    """One keep-alive connection; ``request`` returns the response body's pieces with the time
    each arrived."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiting: asyncio.Future[list[tuple[float, bytes]]] | None = None
        self._pieces: list[tuple[float, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_exception(RuntimeError(f"connection lost: {exc}"))

    def on_body(self, body: bytes) -> None:
        self._pieces.append((time.perf_counter(), body))

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() != 200 and self._waiting is not None:
            self._waiting.set_exception(RuntimeError(f"HTTP {self._parser.get_status_code()}"))
        elif self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(self._pieces)

    async def request(self, raw: bytes) -> list[tuple[float, bytes]]:
        assert self._transport is not None
        self._pieces = []
        self._waiting = asyncio.get_running_loop().create_future()
        self._transport.write(raw)
        return await self._waiting

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _post(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def _events(started: float, pieces: list[tuple[float, bytes]]) -> dict[str, Any]:
    """A stream's text events: when each arrived, TTFT, inter-event gaps, completion tokens."""
    buffer, arrivals, tokens = b"", [], 0
    for at, body in pieces:
        buffer += body
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            chunk = json.loads(event[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or []):
                arrivals.append(at)
    end = pieces[-1][0] if pieces else started
    first = arrivals[0] if arrivals else end
    return {
        "ttft_s": first - started,
        "total_s": end - started,
        "gaps_s": [b - a for a, b in itertools.pairwise(arrivals)],
        "events": len(arrivals),
        "tokens": tokens,
        "late_first": first - started > (end - started) / 2,
    }


async def _load(port: int, prompts: list[str], tokens: int, concurrency: int) -> dict[str, Any]:
    queue, streams = list(prompts), []

    async def connection() -> None:
        _, stream = await asyncio.get_running_loop().create_connection(_Stream, "127.0.0.1", port)
        try:
            while queue:
                body = {
                    "model": MODEL, "messages": [{"role": "user", "content": queue.pop()}],
                    "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0,
                    "stream_options": {"include_usage": True},
                }  # fmt: skip
                started = time.perf_counter()
                streams.append(_events(started, await stream.request(_post(body))))
        finally:
            stream.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return {"streams": streams, "wall_s": time.perf_counter() - started}


def client_main(args: argparse.Namespace) -> int:
    prompts = json.loads(Path(args.prompts).read_text())
    print(json.dumps(asyncio.run(_load(args.port, prompts, args.tokens, args.concurrency))))
    return 0


def _run_client(port: int, prompts: list[str], tokens: int, concurrency: int, work: Path) -> dict[str, Any]:
    path = work / "prompts.json"
    path.write_text(json.dumps(prompts))
    command = [
        sys.executable, "-m", "benchmarks.stream_events", "client", "--port", str(port),
        "--prompts", str(path), "--tokens", str(tokens), "--concurrency", str(concurrency),
    ]  # fmt: skip
    done = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"the client failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ----------------------------------------------------------------------------- the stacks


def _wait_serving(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited ({process.returncode}) before serving on {port}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as answer:
                if MODEL.encode() in answer.read():
                    return
        except OSError:
            pass
        time.sleep(1)  # polling a process we started for its readiness (no event to wait on)
    raise RuntimeError(f"nothing served on {port} within {START_S} s")


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _Ours:
    name = "ours"

    def __init__(self, model_dir: Path, work: Path) -> None:
        discovery = tcp_endpoint()
        self.port = _free_port()
        self.frontend = FileProcess(
            ["frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port",
             str(self.port), "--cache-dir", str(work / "cache")],
            work / "frontend.log",
        )  # fmt: skip
        self.worker = FileProcess(
            ["worker", "--engine", "vllm", "--model-path", str(model_dir), "--served-name", MODEL,
             "--discovery", discovery, *FLAGS],
            work / "worker.log",
        )  # fmt: skip
        _wait_serving(self.port, self.frontend.process)

    @property
    def pids(self) -> list[int]:
        return [self.frontend.pid, self.worker.pid]

    def stalls(self) -> list[dict[str, Any]]:
        return [*self.frontend.find("event_loop_stalled"), *self.worker.find("event_loop_stalled")]

    def stop(self) -> None:
        self.worker.stop(timeout=60)
        self.frontend.stop()


class _Vllm:
    name = "vllm"

    def __init__(self, model_dir: Path, work: Path) -> None:
        self.port = _free_port()
        command = [
            sys.executable, "-m", "benchmarks._vllm_serve", "serve", str(model_dir), "--served-model-name",
            MODEL, "--host", "127.0.0.1", "--port", str(self.port), *FLAGS,
        ]  # fmt: skip
        with (work / "vllm.log").open("w") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
        _wait_serving(self.port, self.process)

    @property
    def pids(self) -> list[int]:
        return [self.process.pid]

    def stalls(self) -> list[dict[str, Any]]:
        return []  # vLLM says nothing of its loop

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ----------------------------------------------------------------------------- the run


def _prompts(rng: random.Random, count: int, tag: str) -> list[str]:
    return [f"[{tag}:{i}] " + " ".join(rng.choice(WORDS) for _ in range(300)) for i in range(count)]


def _measure(args: argparse.Namespace, suite: Suite) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_engine_model import write_engine_model  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="stream-events-"))
    model_dir = write_engine_model(work / MODEL, tokenizer_json=True)
    stacks: list[_Ours | _Vllm] = []
    try:
        stacks.append(_Ours(model_dir, work))
        stacks.append(_Vllm(model_dir, work))
        rng = random.Random(0)
        for stack in stacks:  # warm both up
            _run_client(stack.port, _prompts(rng, 4, "warm"), 16, 2, work)
        results: dict[str, dict[str, Any]] = {}
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        for round_ in range(args.rounds):
            for concurrency in concurrencies:
                prompts = _prompts(rng, max(args.requests, concurrency), f"{round_}:{concurrency}")
                for stack in stacks if round_ % 2 == 0 else stacks[::-1]:
                    before = [cpu_seconds(pid) for pid in stack.pids]
                    load = os.getloadavg()[0]
                    got = _run_client(stack.port, prompts, args.tokens, concurrency, work)
                    cpu = sum(cpu_seconds(pid) for pid in stack.pids) - sum(before)
                    slot = results.setdefault(
                        f"{stack.name}@{concurrency}", {"streams": [], "tps": [], "cpu_s": 0.0, "load": []}
                    )
                    tokens = sum(stream["tokens"] for stream in got["streams"])
                    slot["streams"] += got["streams"]
                    slot["tps"].append(tokens / got["wall_s"])
                    slot["cpu_s"] += cpu
                    slot["load"].append(load)
        stalls = [stall for stack in stacks for stall in stack.stalls()]
        _report(suite, results, concurrencies, stalls)
    finally:
        for stack in stacks:
            stack.stop()


def _figures(slot: dict[str, Any]) -> dict[str, float]:
    streams = slot["streams"]
    tokens = sum(stream["tokens"] for stream in streams)
    events = sum(stream["events"] for stream in streams)
    ttft = [stream["ttft_s"] for stream in streams]
    gaps = [gap for stream in streams for gap in stream["gaps_s"]]
    return {
        "tps": sorted(slot["tps"])[len(slot["tps"]) // 2],
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(gaps, 50) if gaps else float("nan"),
        "events_per_stream": events / len(streams),
        "tokens_per_event": tokens / max(events, 1),
        "late_first": sum(stream["late_first"] for stream in streams),
        "cpu_us_per_token": slot["cpu_s"] / max(tokens, 1) * 1e6,
        "load": sum(slot["load"]) / len(slot["load"]),
    }


def _report(
    suite: Suite,
    results: dict[str, dict[str, Any]],
    concurrencies: Sequence[int],
    stalls: list[dict[str, Any]],
) -> None:
    details: dict[str, Any] = {}
    for concurrency in concurrencies:
        ours, theirs = _figures(results[f"ours@{concurrency}"]), _figures(results[f"vllm@{concurrency}"])
        details[str(concurrency)] = {"ours": ours, "vllm": theirs}
        at = f"at {concurrency} stream(s)"
        rows = (
            ("output tokens/s", "tps", ">= 1.0x", lambda r: r >= 1.0),
            ("TTFT p50", "ttft_p50", "<= 1.0x", lambda r: r <= 1.0),
            ("TTFT p99", "ttft_p99", "<= 1.2x", lambda r: r <= 1.2),
            ("ITL p50 per event", "itl_p50", "<= 1.2x", lambda r: r <= 1.2),
            ("CPU per output token outside the engine", "cpu_us_per_token", "<= 1.0x", lambda r: r <= 1.0),
        )
        for title, key, target, met in rows:
            ratio = ours[key] / theirs[key]
            suite.record(
                f"{title} {at}, ours / vllm serve", ratio, "x", target, met(ratio),
                note=f"{ours[key]:.4g} / {theirs[key]:.4g}; load {ours['load']:.1f}",
            )  # fmt: skip
        suite.record(
            f"events per stream {at}, ours / vllm serve", ours["events_per_stream"], "events",
            note=f"vllm {theirs['events_per_stream']:.1f}; tokens per event {ours['tokens_per_event']:.2f} / "
            f"{theirs['tokens_per_event']:.2f}; first text after half its time {ours['late_first']} / "
            f"{theirs['late_first']} streams",
        )  # fmt: skip
    longest = max((stall["stalled_ms"] for stall in stalls), default=0.0)
    causes = sorted({stall["cause"] for stall in stalls})
    suite.record(
        "longest event-loop stall, frontend and worker", longest, "ms", "<= 100 ms", longest <= 100,
        note=f"{len(stalls)} stalls over 100 ms, cause {', '.join(causes) or '-'}",
    )  # fmt: skip
    suite.details = {"figures": details, "stalls": stalls, "flags": list(FLAGS)}
    print(suite.write(), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client")
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--prompts", required=True)
    client.add_argument("--tokens", type=int, required=True)
    client.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    args = parser.parse_args(argv)
    if args.command == "client":
        return client_main(args)
    _measure(args, Suite("stream_events"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
