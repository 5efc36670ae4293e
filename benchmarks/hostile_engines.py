"""Issue 25, rows 9, 10, 12, 14 and 15: hung, starved, saturated and lost engines, against a real frontend.

``python -m benchmarks.hostile_engines [--only NAME ...] [--vllm]``

Real ``dynamo-prep`` processes logging to files (a frontend, mock workers) and, for the frontend's
own stall deadline, a raw-pyzmq worker that streams five tokens and then only answers pings
(``tests/support/fake_worker.py``). ``/live`` is polled every 10 ms by a process of its own
(``benchmarks.hostile``'s poller). Per scenario: what each client got, how long it took, and the
longest ``/live``. New frontend knobs are given as environment variables, so the same scenarios
run against the old code (a checkout of the commit before this work, with this file,
``benchmarks/_hostile_worker.py`` and ``tests/support/fake_worker.py`` copied in, run from that
tree: the processes are started as ``python -m dynamo_prep.cli`` from the current directory);
scenarios that need a new worker flag (``--slots``, ``--engine-stall-timeout``, the mock's fault
signals) cannot run there.

``--vllm`` (in the engines' venv, ``.venv-engines``) runs rows 9 and 14 as the issue measured them
instead: two ``--engine vllm`` workers on the tiny dummy-weight model of ``tests/engines/`` (a new
pair per scenario), whose engine core (the ``VLLM::EngineCore`` child) is stopped mid-stream, or
killed just before a request is routed to its worker; every deadline at its default but a 90 s
request timeout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._hostile_worker import announce, live_max_ms, polled, start_frontend
from benchmarks._plane import DEMO_MODEL, TESTS_DIR, FileProcess, free_port, reap, tcp_endpoint
from benchmarks._rows import named, run_rows
from benchmarks.hostile import LogTail
from dynamo_prep.protocol import wire

LONG_TEXT = "please keep talking for a while, so that this stream lasts long enough to be interrupted"

from support.fake_worker import FakeWorker, Frames  # noqa: E402  (tests/ is on the path: _plane)

TOKEN = 3_000  # an ordinary id of the demo vocabulary
SCHEMA = {
    "type": "object",
    "properties": {f"field_{index}": {"type": "string", "minLength": 24} for index in range(8)},
    "required": [f"field_{index}" for index in range(8)],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "long", "schema": SCHEMA}}
CLIENT_TIMEOUT_S = 150.0
VLLM_MODEL = "engmodel"


def five_then_silence(worker: FakeWorker, request: wire.Generate) -> Frames:
    """Five tokens, then nothing but pongs: a hung engine seen from the frontend."""
    del worker
    for _ in range(5):
        yield wire.encode(wire.Output(request_id=request.request_id, token_ids=[TOKEN]))


@dataclass
class Bench:
    tmp: Path
    env: dict[str, str]
    plane: str = field(default_factory=tcp_endpoint)
    port: int = field(default_factory=free_port)
    procs: list[FileProcess] = field(default_factory=list)
    workers: dict[str, FileProcess] = field(default_factory=dict)  # instance_id -> process
    log: LogTail | None = None
    model: str = DEMO_MODEL

    def start(self, workers: list[list[str]]) -> None:
        os.environ.update(self.env)
        self.log = start_frontend(self.procs, self.tmp, self.plane, self.port, log_level="debug")
        for index, flags in enumerate(workers):
            mock = () if "--engine" in flags else ("--flavor", "sglang")
            args = ["--log-level", "info", "worker", "--model-path", DEMO_MODEL, "--discovery", self.plane,
                    *mock, *flags]  # fmt: skip
            proc = FileProcess(args, self.tmp / f"worker{index}.log")
            self.procs.append(proc)
            self.workers[proc.wait_event("worker_started", timeout=300)["instance_id"]] = proc
        for instance_id in self.workers:
            self.log.wait("instance_added", timeout=60, instance_id=instance_id)
        if workers:
            self.log.wait("model_added", timeout=60)

    def announce(self, worker: FakeWorker) -> None:
        """Announce a raw-pyzmq worker (its card allows one move) until the frontend has it."""
        assert self.log is not None
        announce(self.plane, self.log, worker.endpoint, worker.card_fields(migration_limit=1))

    def first(self) -> FileProcess:
        """The worker a fresh frontend's round robin picks first (the smallest instance id)."""
        return self.workers[min(self.workers)]

    def serving(self) -> FileProcess:
        assert self.log is not None
        return self.workers[self.log.find("request_routed")[-1]["instance_id"]]

    def at_third(self, signum: int) -> Callable[[int], None]:
        """Signal the serving worker at a stream's third content chunk."""

        def send(chunks: int) -> None:
            if chunks == 3:
                self.serving().process.send_signal(signum)

        return send

    def stream(
        self, text: str, at_chunk: Callable[[int], None] = lambda _: None, **extra: Any
    ) -> dict[str, Any]:
        """One streamed chat: its status, seconds, content, error (if any) and chunks."""
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "stream": True, **extra}
        content, error, chunks = "", None, 0
        started = time.monotonic()
        with (
            httpx.Client(trust_env=False, timeout=CLIENT_TIMEOUT_S) as http,
            http.stream("POST", f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body) as response,
        ):
            if response.status_code != 200:
                error = json.loads(response.read())["error"]["message"][:120]
                return {"status": response.status_code, "seconds": round(time.monotonic() - started, 2),
                        "error": error}  # fmt: skip
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                piece = event["choices"][0]["delta"].get("content") if event["choices"] else None
                if piece:
                    content += piece
                    chunks += 1
                    at_chunk(chunks)
        return {
            "status": error["code"] if error else 200,
            "seconds": round(time.monotonic() - started, 2),
            "content": content,
            "error": error["message"][:120] if error else None,
            "chunks": chunks,
        }

    def chat(self, text: str, **extra: Any) -> httpx.Response:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], **extra}
        with httpx.Client(trust_env=False, timeout=CLIENT_TIMEOUT_S) as http:
            return http.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body)

    def events(self, *names: str) -> dict[str, int]:
        assert self.log is not None
        return {name: count for name in names if (count := len(self.log.find(name)))}

    def stop(self) -> None:
        for proc in self.procs:
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGCONT)
        reap(self.procs)


EVENTS = ("request_migrated", "migration_refused", "worker_stream_stalled", "worker_no_first_token",
          "worker_busy_kept", "worker_expired_delivering", "worker_lost", "request_refused_saturated",
          "instance_removed")  # fmt: skip


def stalled_stream(bench: Bench) -> dict[str, Any]:
    """Row 9 (the frontend's deadline): two streams, round robin sends one to the raw worker that
    stops after five tokens and only answers pings."""
    worker = FakeWorker(DEMO_MODEL, five_then_silence)
    try:
        bench.announce(worker)
        results = [bench.stream(f"{LONG_TEXT} {index}") for index in range(2)]
    finally:
        worker.close()
    return {"streams": [{k: v for k, v in r.items() if k != "content"} for r in results]}


def hung_engine(bench: Bench) -> dict[str, Any]:
    """Row 9 (the worker's watchdog): the serving mock worker's engine is held after 3 chunks."""
    expected = bench.chat(LONG_TEXT).json()["choices"][0]["message"]["content"]
    result = bench.stream(LONG_TEXT, bench.at_third(signal.SIGUSR1))
    result["whole"] = result.pop("content") == expected
    return result


def expired_delivering(bench: Bench) -> dict[str, Any]:
    """Row 10: the only worker is stopped mid-stream until the frontend expires it, then thawed."""
    assert bench.log is not None
    log = bench.log
    [worker] = bench.workers.values()
    expected = bench.chat(LONG_TEXT).json()["choices"][0]["message"]["content"]

    def freeze(chunks: int) -> None:
        if chunks == 3:
            worker.process.send_signal(signal.SIGSTOP)
            try:
                log.wait("instance_removed", timeout=20, reason="expired")
            finally:
                worker.process.send_signal(signal.SIGCONT)

    result = bench.stream(LONG_TEXT, freeze)
    result["whole"] = result.pop("content") == expected
    return result


def busy_queue(bench: Bench, requests: int = 6) -> dict[str, Any]:
    """Row 15: six ~1,000-token prompts at once on two workers whose prefills queue (about 2 s
    each), with a 2 s first-token timeout."""
    outcomes: list[tuple[int, float]] = []

    def ask(index: int) -> None:
        prompt = f"prompt {index}: " + " ".join(f"w{index}x{word}" for word in range(400))
        started = time.monotonic()
        outcomes.append((bench.chat(prompt).status_code, time.monotonic() - started))

    _together(requests, ask)
    return {"statuses": dict(Counter(status for status, _ in outcomes)),
            "slowest_s": round(max(seconds for _, seconds in outcomes), 2)}  # fmt: skip


def saturated(bench: Bench, requests: int = 8) -> dict[str, Any]:
    """Row 15: eight long chats at once on two workers of one slot each, two may queue."""
    outcomes: list[tuple[int, float, str | None]] = []

    def ask(index: int) -> None:
        started = time.monotonic()
        response = bench.chat(f"{LONG_TEXT} {index}")
        outcomes.append(
            (response.status_code, time.monotonic() - started, response.headers.get("retry-after"))
        )

    _together(requests, ask)
    refused = [seconds for status, seconds, _ in outcomes if status == 503]
    return {
        "statuses": dict(Counter(status for status, _, _ in outcomes)),
        "retry_after": sorted({after for _, _, after in outcomes if after}),
        "refused_within_s": round(max(refused), 2) if refused else None,
        "served_slowest_s": round(max(seconds for status, seconds, _ in outcomes if status == 200), 2),
    }


def structured_lost(bench: Bench) -> dict[str, Any]:
    """Row 12: a json_schema stream whose worker is killed after 3 content chunks, a move allowed."""
    result = bench.stream("a record", bench.at_third(signal.SIGKILL), response_format=RESPONSE_FORMAT)
    content = result.pop("content")
    try:
        json.loads(content)
        result["content"] = "one whole JSON text"
    except ValueError:
        result["content"] = f"not JSON ({len(content)} characters)"
    return result


def _together(count: int, work: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=work, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_S + 10)


@dataclass
class Scenario:
    name: str
    row: int
    client: Callable[[Bench], dict[str, Any]]
    workers: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)
    new_only: bool = False  # needs a worker flag or signal the old code does not have


MIGRATE = ["--token-delay", "0.04", "--migration-limit", "1"]
QUEUED = ["--token-delay", "0.01", "--kv-events", "--prefill-ms-per-1k", "1500", "--heartbeat", "0.2"]
SCENARIOS = (
    Scenario("stalled_stream", 9, stalled_stream, [["--token-delay", "0.04", "--migration-limit", "1"]],
             env={"DYN_REQUEST_TIMEOUT": "30", "DYN_STREAM_STALL_TIMEOUT": "5"}),
    Scenario("hung_engine", 9, hung_engine, [[*MIGRATE, "--engine-stall-timeout", "5"]] * 2,
             env={"DYN_REQUEST_TIMEOUT": "30"}, new_only=True),
    Scenario("expired_delivering", 10, expired_delivering,
             [["--token-delay", "0.05", "--heartbeat", "0.2", "--ttl-ms", "1000"]]),
    Scenario("busy_queue", 15, busy_queue, [QUEUED] * 2, env={"DYN_FIRST_TOKEN_TIMEOUT": "2"}),
    Scenario("saturated", 15, saturated, [["--token-delay", "0.05", "--slots", "1"]] * 2,
             env={"DYN_MAX_QUEUED_REQUESTS": "2"}, new_only=True),
    Scenario("structured_lost", 12, structured_lost, [MIGRATE] * 2),
)  # fmt: skip


def engine_core(worker: FileProcess) -> int:
    """The pid of a vLLM worker's engine core (its ``VLLM::EngineCore`` child)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == worker.pid and cmdline.startswith(b"VLLM::"):
                return int(entry.name)
    raise AssertionError(f"no engine core under {worker.pid}")


def vllm_core_stopped(bench: Bench) -> dict[str, Any]:
    """Row 9: SIGSTOP to the engine core serving a 300-token stream, after its 4th chunk."""
    first = bench.first()
    core = engine_core(first)
    try:
        result = bench.stream("A long answer, please.", _at(4, lambda: os.kill(core, signal.SIGSTOP)),
                              max_tokens=300, ignore_eos=True)  # fmt: skip
    finally:
        os.kill(core, signal.SIGCONT)
    result.pop("content", None)
    return result


def vllm_core_killed(bench: Bench) -> dict[str, Any]:
    """Row 14: SIGKILL to an engine core, then at once a request routed to its worker."""
    core = engine_core(bench.first())
    os.kill(core, signal.SIGKILL)
    started = time.monotonic()
    response = bench.chat("Still there?", max_tokens=16)
    return {"status": response.status_code, "seconds": round(time.monotonic() - started, 2)}


def _at(chunk: int, action: Callable[[], None]) -> Callable[[int], None]:
    def run(chunks: int) -> None:
        if chunks == chunk:
            action()

    return run


def vllm_workers(tmp: Path) -> list[list[str]]:
    """The flags of two vLLM workers on tests/engines/' model (written here), one move allowed."""
    spec = importlib.util.spec_from_file_location("engine_conftest", TESTS_DIR / "engines" / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = conftest  # its dataclasses look their module up
    spec.loader.exec_module(conftest)
    model = conftest._engine_model_module().write_engine_model(tmp / VLLM_MODEL)
    flags = ["--engine", "vllm", "--model-path", str(model), "--migration-limit", "1", *conftest.VLLM_FLAGS]
    return [list(flags), list(flags)]


VLLM_SCENARIOS = (
    Scenario("vllm_core_stopped", 9, vllm_core_stopped, [], env={"DYN_REQUEST_TIMEOUT": "90"}),
    Scenario("vllm_core_killed", 14, vllm_core_killed, [], env={"DYN_REQUEST_TIMEOUT": "90"}),
)


def measure(scenario: Scenario, tmp: Path) -> dict[str, Any]:
    bench = Bench(tmp, scenario.env, model=DEMO_MODEL if scenario.workers else VLLM_MODEL)
    try:
        bench.start(scenario.workers or vllm_workers(tmp))
        result, samples = polled(bench.port, tmp, lambda: scenario.client(bench))
        result.update(live_max_ms=live_max_ms(samples), frontend_lines=bench.events(*EVENTS))
        return result
    finally:
        bench.stop()
        for name in scenario.env:
            os.environ.pop(name, None)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile_engines", description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="scenarios whose name contains one of these")
    parser.add_argument("--old", action="store_true", help="skip the scenarios the old code cannot run")
    parser.add_argument("--vllm", action="store_true", help="rows 9 and 14 on a real vLLM (.venv-engines)")
    args = parser.parse_args()
    if args.vllm:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    chosen = named(args.only, VLLM_SCENARIOS if args.vllm else SCENARIOS)
    return run_rows((s for s in chosen if not (args.old and s.new_only)), measure, "scenario")


if __name__ == "__main__":
    raise SystemExit(main())
