"""Issue 25, rows 1, 2, 4 and 11: schema bombs against a real frontend and a mock worker.

``python -m benchmarks.hostile_schemas [--only NAME ...]``

A real ``dynamo-prep frontend`` and a real mock worker (``qwen-vl-demo``), logs to files. During
each attack a poller process sends ``GET /live`` every 10 ms (``benchmarks.hostile``'s); per
attack: what each client got and how long it waited, the longest ``/live``, the CPU seconds of the
frontend and its children during the attack and in the 10 s after it, its peak RSS, and the
instances the frontend lost (expired workers). For the old code, run this file from a checkout of
the old tree (``git archive <commit> | tar -x -C DIR``, with ``benchmarks/`` copied in): the
frontend runs as ``python -m dynamo_prep.cli`` from the current directory.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks._plane import DEMO_MODEL, FileProcess, free_port, reap, tcp_endpoint
from benchmarks._rows import named, run_rows
from benchmarks.hostile import LogTail, Poller

AFTER_S = 10.0  # CPU is measured this long after an attack's clients are gone
USER = [{"role": "user", "content": "Tell me about Paris."}]


def type_bomb(items: int) -> dict[str, Any]:
    return {"type": [{}, *([index] for index in range(items))]}


def chat(schema: Any, **fields: Any) -> dict[str, Any]:
    response_format = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}
    return {"model": DEMO_MODEL, "messages": USER, "response_format": response_format, **fields}


def responses(schema: Any) -> dict[str, Any]:
    text = {"format": {"type": "json_schema", "name": "bomb", "schema": schema}}
    return {"model": DEMO_MODEL, "input": "Tell me about Paris.", "text": text}


def forced(schema: Any) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {"model": DEMO_MODEL, "messages": USER, "tools": [tool], "tool_choice": "required"}


@dataclass
class Bench:
    tmp: Path
    port: int = 0
    log: LogTail | None = None

    def __post_init__(self) -> None:
        self.port = free_port()
        plane = tcp_endpoint()
        self.frontend = FileProcess(
            ["--log-level", "info", "frontend", "--discovery-bind", plane, "--http-host", "127.0.0.1",
             "--http-port", str(self.port), "--cache-dir", str(self.tmp / "cache")],
            self.tmp / "frontend.log",
        )  # fmt: skip
        self.log = LogTail(self.frontend.log_path)
        self.log.wait("frontend_started")
        args = ["--log-level", "info", "worker", "--model-path", DEMO_MODEL, "--discovery", plane,
                "--token-delay", "0", "--migration-limit", "1"]  # fmt: skip
        self.worker = FileProcess(args, self.tmp / "worker.log")
        self.log.wait("model_added", timeout=60)

    def post(self, path: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, float, int]:
        """(status, seconds, answer bytes); status 0: the client gave up at ``timeout``."""
        started = time.monotonic()
        try:
            with httpx.Client(trust_env=False, timeout=timeout) as http:
                answer = http.post(f"http://127.0.0.1:{self.port}{path}", json=body)
        except httpx.TimeoutException:
            return 0, time.monotonic() - started, 0
        return answer.status_code, time.monotonic() - started, len(answer.content)

    def leaving(self, body: dict[str, Any], after_s: float) -> None:
        """A client that sends ``body`` and leaves after ``after_s``."""
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n"
        ).encode()
        client = socket.create_connection(("127.0.0.1", self.port))
        client.sendall(head + data)
        time.sleep(after_s)  # the client's patience: the attack's own figure
        client.close()

    def cpu_s(self) -> float:
        """CPU seconds of the frontend, its reaped children and its live ones."""
        pid = self.frontend.pid
        own = _stat(pid)
        total = own[0] + own[1] + own[2] + own[3]
        for child in Path("/proc").iterdir():
            if child.name.isdigit():
                try:
                    fields = _stat(int(child.name))
                except OSError:
                    continue
                if fields[4] == pid:
                    total += fields[0] + fields[1]
        return total / 100

    def rss_peak_mb(self) -> float:
        for line in Path(f"/proc/{self.frontend.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        reap([self.worker, self.frontend])


def _stat(pid: int) -> tuple[int, int, int, int, int]:
    """utime, stime, cutime, cstime (clock ticks) and the parent's pid."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]), int(fields[12]), int(fields[13]), int(fields[14]), int(fields[1])


def one_each(bench: Bench, schema: Any) -> dict[str, Any]:
    """The schema in a chat, in Responses' text.format and as a forced tool's parameters."""
    found = {}
    for name, path, body in (
        ("chat", "/v1/chat/completions", chat(schema)),
        ("responses", "/v1/responses", responses(schema)),
        ("forced_tool", "/v1/chat/completions", forced(schema)),
    ):
        status, seconds, size = bench.post(path, body)
        found[name] = f"{status} in {seconds:.2f} s ({size} bytes)"
    return found


def twice(bench: Bench, schema: Any) -> dict[str, Any]:
    results = [bench.post("/v1/chat/completions", chat(schema)) for _ in range(2)]
    return {"chats": [f"{status} in {seconds:.2f} s" for status, seconds, _ in results]}


def six_leaving(bench: Bench, schema: Any) -> dict[str, Any]:
    """Row 2: six clients send 200 KB and leave after 5 s; then a legitimate 40 KB chat."""
    clients = [threading.Thread(target=bench.leaving, args=(chat(schema), 5.0)) for _ in range(6)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    legit = chat({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    legit["messages"] = [{"role": "user", "content": "Where is Paris?" + " " * 40_000}]  # 40 KB, few tokens
    status, seconds, _ = bench.post("/v1/chat/completions", legit, timeout=60)
    return {"legitimate_40kb_chat": f"{status} in {seconds:.2f} s" if status else "no answer in 60 s"}


def worker_bomb(bench: Bench, schema: Any) -> dict[str, Any]:
    """Row 11: a tiny schema whose instance is huge, then 9 healthy chats."""
    status, seconds, _ = bench.post("/v1/chat/completions", chat(schema))
    healthy = [
        bench.post("/v1/chat/completions", {"model": DEMO_MODEL, "messages": USER})[0] for _ in range(9)
    ]
    return {"bomb": f"{status} in {seconds:.2f} s", "healthy_ok": sum(code == 200 for code in healthy)}


@dataclass
class Attack:
    name: str
    row: int
    run: Callable[[Bench, Any], dict[str, Any]]
    schema: Any


ATTACKS = (
    Attack("type_list_32kb", 1, one_each, type_bomb(4_500)),
    Attack("type_list_13kb_twice", 1, twice, type_bomb(1_800)),
    Attack("type_list_200kb_clients_leave", 2, six_leaving, type_bomb(25_000)),
    Attack("enum_200k_strings", 4, one_each, {"enum": [f"value-{index}" for index in range(200_000)]}),
    Attack("required_20k", 4, one_each, {"type": "object", "required": [f"p{i}" for i in range(20_000)]}),
    Attack("min_length_3e7", 11, worker_bomb, {"type": "string", "minLength": 30_000_000}),
    Attack("min_length_1e8", 11, worker_bomb, {"type": "string", "minLength": 100_000_000}),
)


def measure(attack: Attack, tmp: Path) -> dict[str, Any]:
    bench = Bench(tmp)
    poller: Poller | None = None
    try:
        cpu = bench.cpu_s()
        poller = Poller(bench.port, 10.0, tmp / "live.txt")
        result = attack.run(bench, attack.schema)
        samples = poller.stop()
        poller = None
        during = bench.cpu_s()
        time.sleep(AFTER_S)  # the window whose CPU is the figure
        after = bench.cpu_s()
        assert bench.log is not None
        bench.log.refresh()
        result.update(
            live_max_ms=round(max(latency for _, latency, _ in samples), 1),
            live_failed=sum(1 for _, _, status in samples if status != 200),
            cpu_during_s=round(during - cpu, 2),
            cpu_after_s=round(after - during, 2),
            rss_peak_mb=round(bench.rss_peak_mb()),
            instances_lost=len(bench.log.find("instance_removed")) + len(bench.log.find("instance_expired")),
        )
        return result
    finally:
        if poller is not None:
            poller.stop()
        bench.stop()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile_schemas", description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="attacks whose name contains one of these")
    args = parser.parse_args()
    return run_rows(named(args.only, ATTACKS), measure, "attack")


if __name__ == "__main__":
    raise SystemExit(main())
