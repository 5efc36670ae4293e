"""Sockets and files at scale and under attack (issue 20, rows 2, 3, 11 and 17, and the target).

``python -m benchmarks.sockets [--only NAME ...]``

Real ``dynamo-prep frontend`` processes on loopback at this shell's open-file limits; the workers
they see are cheap: ONE ROUTER bound on many ports answers each port's requests as a worker would
(a one-token answer, Pongs), one PUB bound on as many ports is each instance's KV publisher and one
ROUTER more its replay endpoint (an empty replay). Announces are written raw, as any peer can.

* ``kv_publishers``: 300 instances announced with KV and replay endpoints (row 2: the frontend exited).
* ``round_robin``: 1,100 live instances, 1,200 chats round robin (row 3: chats 1,022 onward 500).
* ``listeners``: 20 instances whose KV endpoint is a plain listener dropping every connection
  (row 11: 212 connections a second); connections per second over a 10 s window.
* ``thief``: an announce naming a real worker's KV endpoint; of 20 chats of the prefix that worker
  holds, how many went to the thief (row 17: 10).
* ``scale``: 10,000 announced instances, 2,000 of them serving and publishing KV events (kv mode),
  2,400 chats 16 at a time: statuses, instances followed, refusals, the frontend's descriptors.

Each scenario polls ``/live`` every 10 ms from a process of its own meanwhile (failures, the maximum).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from benchmarks._plane import DEMO_MODEL, DynamoProcess, free_port, scrape_metrics, start_dynamo, tcp_endpoint
from benchmarks._report import Suite
from benchmarks.hostile import Poller
from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.protocol import wire
from dynamo_prep.protocol.kv_events import END_SEQ

TOPIC = b"dynamo_prep.v1.card.dynamo"
CARD: dict[str, Any] = msgspec.msgpack.decode(encode_card(ModelDeploymentCard.from_model_dir(DEMO_MODEL)))


class Fleet:
    """``count`` instances on three sockets (request ROUTER, KV PUB, replay ROUTER), one thread."""

    def __init__(self, count: int, *, kv: bool = True) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 64)
        self.router = self._socket(zmq.ROUTER)
        self.endpoints = [self._bind(self.router) for _ in range(count)]
        self.pub = self._socket(zmq.PUB) if kv else None
        self.replay = self._socket(zmq.ROUTER) if kv else None
        self.kv = [self._bind(self.pub) for _ in range(count)] if self.pub else []
        self.replays = [self._bind(self.replay) for _ in range(count)] if self.replay else []
        self.generates: Counter[bytes] = Counter()  # by the frontend DEALER's identity
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    @staticmethod
    def _bind(sock: zmq.Socket[Any] | None) -> str:
        assert sock is not None
        return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock is self.replay:
                    sock.send_multipart([frames[0], b"", b"", END_SEQ, b""])
                else:
                    self._answer(frames[0], frames[1])

    def _answer(self, identity: bytes, payload: bytes) -> None:
        message = wire.decode_to_worker(payload)
        if isinstance(message, wire.Ping):
            reply: wire.FromWorker = wire.Pong(request_id=message.request_id)
        elif isinstance(message, wire.Generate):
            self.generates[identity] += 1
            reply = wire.Output(
                request_id=message.request_id, token_ids=[100], finish_reason="stop",
                prompt_tokens=len(message.request.token_ids), completion_tokens=1,
            )  # fmt: skip
        else:
            return
        self.router.send_multipart([identity, wire.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.context.destroy(linger=0)


class Listeners:
    """Plain TCP listeners that accept and close at once, counting connections."""

    def __init__(self, count: int) -> None:
        self.accepted = 0
        self._selector = selectors.DefaultSelector()
        self.ports = []
        for _ in range(count):
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen(128)
            server.setblocking(False)
            self.ports.append(server.getsockname()[1])
            self._selector.register(server, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                with contextlib.suppress(BlockingIOError):
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    self.accepted += 1
                    conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


class LivePoller:
    """``GET /live`` every 10 ms on one keep-alive connection, from a process of its own (so this
    process's threads, the fleet and the announcer, never hold its GIL)."""

    def __init__(self, port: int, out: Path) -> None:
        self._poller = Poller(port, 10.0, out)

    def stop(self) -> str:
        samples = self._poller.stop()
        failures = sum(1 for _, _, status in samples if status != 200)
        worst = max((latency for _, latency, _ in samples), default=0.0)
        return f"/live: {failures} of {len(samples)} polls failed, max {worst:.0f} ms"


class Stack:
    """A frontend on its own plane and HTTP port, an attacker PUB, the processes to reap."""

    def __init__(self, tmp: Path, *frontend_args: str, worker: bool = False, kv_worker: bool = False) -> None:
        self.plane = tcp_endpoint()
        self.port = free_port()
        self.procs: list[DynamoProcess] = []
        self.frontend = start_dynamo(
            "frontend", "--discovery-bind", self.plane, "--http-host", "127.0.0.1",
            "--http-port", str(self.port), "--cache-dir", str(tmp / f"cache-{self.port}"), *frontend_args,
            log_level="info",
        )  # fmt: skip
        self.procs.append(self.frontend)
        self.worker: DynamoProcess | None = None
        if worker or kv_worker:
            extra = ("--kv-events",) if kv_worker else ()
            self.worker = start_dynamo(
                "worker", "--model-path", DEMO_MODEL, "--discovery", self.plane, "--token-delay", "0", *extra,
                log_level="info",
            )  # fmt: skip
            self.procs.append(self.worker)
        self.frontend.wait_event("frontend_started", timeout=60)
        self.context: zmq.Context[Any] = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.connect(self.plane)
        self.live = LivePoller(self.port, tmp / f"live-{self.port}.txt")

    def alive(self) -> bool:
        return self.frontend.process.poll() is None

    def announce(
        self, payloads: list[dict[str, Any]], until: Callable[[], bool], bound_s: float = 60
    ) -> bool:
        """Send ``payloads`` again and again until ``until()`` (or the frontend died, or the bound)."""
        deadline = time.monotonic() + bound_s
        while not until() and self.alive() and time.monotonic() < deadline:
            for payload in payloads:
                self.pub.send_multipart([TOPIC, msgspec.msgpack.encode(payload)])
            time.sleep(0.2 if len(payloads) > 1000 else 0.05)  # a resend period; ``until`` decides
        return until()

    def added(self) -> int:
        return len(self.frontend.find("instance_added"))

    def chat(self, content: str) -> int:
        try:
            with httpx.Client(trust_env=False, timeout=60) as http:
                return http.post(
                    f"http://127.0.0.1:{self.port}/v1/chat/completions",
                    json={
                        "model": DEMO_MODEL,
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": 4,
                    },
                ).status_code
        except httpx.HTTPError:
            return 0

    def metric(self, name: str) -> float:
        if not self.alive():
            return float("nan")
        with contextlib.suppress(httpx.HTTPError):
            return scrape_metrics(self.port).get(name, 0.0)
        return float("nan")

    def close(self) -> str:
        note = self.live.stop()
        self.pub.close(linger=0)
        self.context.term()
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(timeout=20)
        return note


def announce(instance_id: str, endpoint: str, kv: str | None = None, card: dict[str, Any] | None = None,
             replay: str | None = None) -> dict[str, Any]:  # fmt: skip
    payload = {
        "v": 1, "kind": "announce", "sent_ms": 0, "ttl_ms": 600_000, "instance_id": instance_id, "seq": 1,
        "endpoint": endpoint, "card": card or CARD,
    }  # fmt: skip
    if kv is not None:
        payload["kv_events"] = {"endpoint": kv, **({"replay_endpoint": replay} if replay else {})}
    return payload


def statuses(codes: list[int]) -> str:
    return ", ".join(f"{count} x {code}" for code, count in sorted(Counter(codes).items()))


def fds(pid: int) -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return -1


# -- scenarios ----------------------------------------------------------------------------------


def kv_publishers(suite: Suite, tmp: Path) -> None:
    stack = Stack(tmp, "--router-mode", "kv", worker=True)
    try:
        stack.frontend.wait_event("model_added", timeout=60)
        payloads = [
            announce(
                f"kv-{i}",
                "tcp://127.0.0.1:9",
                f"tcp://127.0.0.1:{21000 + i}",
                replay=f"tcp://127.0.0.1:{22000 + i}",
            )
            for i in range(300)
        ]
        stack.announce(payloads, lambda: stack.added() >= 301)
        time.sleep(3)  # an observation window: what the frontend does with them
        alive = stack.alive()
        followed = stack.metric("dynamo_frontend_kv_instances_followed")
        chat = stack.chat("after") if alive else 0
    finally:
        live = stack.close()
    suite.record(
        "row 2: 300 instances with KV endpoints: frontend alive",
        float(alive),
        "bool",
        "1",
        alive,
        f"{stack.added() - 1} admitted, {followed:g} followed, a chat after: {chat}; {live}",
    )


def round_robin(suite: Suite, tmp: Path, count: int = 1100, chats: int = 1200) -> None:
    stack = Stack(tmp, worker=True)
    fleet = Fleet(count, kv=False)
    try:
        stack.frontend.wait_event("model_added", timeout=60)
        payloads = [announce(f"live-{i}", endpoint) for i, endpoint in enumerate(fleet.endpoints)]
        stack.announce(payloads, lambda: stack.added() >= count + 1, bound_s=120)
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(stack.chat, [f"q{i}" for i in range(chats)]))
        five = sum(code >= 500 for code in codes)
        channels = len(fleet.generates)
        alive = stack.alive()
    finally:
        live = stack.close()
        fleet.close()
    suite.record(
        f"row 3: {count} live instances round robin, {chats} chats: 5xx",
        float(five),
        "responses",
        "",
        None,
        f"{statuses(codes)}; {channels} request-plane connections answered; frontend alive: {alive}; {live}",
    )


def listeners(suite: Suite, tmp: Path, count: int = 20, window_s: float = 10.0) -> None:
    stack = Stack(tmp, "--router-mode", "kv", "--model-path", DEMO_MODEL)
    targets = Listeners(count)
    try:
        payloads = [
            announce(f"l-{i}", "tcp://127.0.0.1:9", f"tcp://127.0.0.1:{port}")
            for i, port in enumerate(targets.ports)
        ]
        stack.announce(payloads, lambda: len(stack.frontend.find("kv_events_subscribed")) >= count)
        time.sleep(2)
        before, started = targets.accepted, time.monotonic()
        time.sleep(window_s)
        rate = (targets.accepted - before) / (time.monotonic() - started)
        total = targets.accepted
    finally:
        live = stack.close()
        targets.close()
    suite.record(
        f"row 11: {count} KV endpoints at listeners that drop connections: connections",
        rate,
        "/s",
        "",
        None,
        f"{window_s:g} s window from 2 s after all were followed; {total} connections in all; {live}",
    )


def thief(suite: Suite, tmp: Path, chats: int = 20) -> None:
    stack = Stack(tmp, "--router-mode", "kv", kv_worker=True)
    fleet = Fleet(1, kv=False)
    try:
        stack.frontend.wait_event("model_added", timeout=60)
        worker_id = stack.worker.wait_event("worker_started")["instance_id"] if stack.worker else ""
        real = stack.frontend.wait_event("kv_events_subscribed", instance_id=worker_id, timeout=30)
        prompt = "the same long system prompt, " * 40
        stack.chat(prompt)  # the worker caches the prefix and says so
        time.sleep(1)
        payload = announce("thief", fleet.endpoints[0], real["endpoint"], replay=real.get("replay_endpoint"))
        stack.announce([payload], lambda: stack.added() >= 2)
        time.sleep(2)  # followed or refused by now
        codes = [stack.chat(f"{prompt} question {i}") for i in range(chats)]
        taken = sum(fleet.generates.values())
        refusal = [e["reason"] for e in stack.frontend.find("kv_events_refused", instance_id="thief")]
    finally:
        live = stack.close()
        fleet.close()
    suite.record(
        f"row 17: an announce naming a worker's KV endpoint: chats of its prefix taken (of {chats})",
        float(taken),
        "chats",
        "0",
        taken == 0,
        f"{statuses(codes)}; refused: {refusal or 'no'}; {live}",
    )


def scale(suite: Suite, tmp: Path, announced: int = 10_000, serving: int = 2_000, chats: int = 2_400) -> None:
    stack = Stack(tmp, "--router-mode", "kv", "--model-path", DEMO_MODEL)
    fleet = Fleet(serving)
    standby = {**CARD, "display_name": "standby-model", "slug": "standby-model"}
    try:
        payloads = [
            announce(f"s-{i}", fleet.endpoints[i], fleet.kv[i], replay=fleet.replays[i])
            for i in range(serving)
        ] + [
            announce(f"a-{i}", f"tcp://127.0.0.1:{30000 + i % 20000}", card=standby)
            for i in range(announced - serving)
        ]
        started = time.monotonic()
        stack.announce(payloads, lambda: stack.added() >= announced, bound_s=180)
        converged = time.monotonic() - started
        with contextlib.suppress(AssertionError):
            until = time.monotonic() + 60
            while (
                stack.metric("dynamo_frontend_kv_instances_followed") < serving and time.monotonic() < until
            ):
                time.sleep(0.5)
        followed = stack.metric("dynamo_frontend_kv_instances_followed")
        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(stack.chat, [f"question {i}" for i in range(chats)]))
        five = sum(code >= 500 or code == 0 for code in codes)
        limits = stack.frontend.find("process_limits_set")
        descriptors = fds(stack.frontend.pid)
        refused = stack.frontend.find("kv_events_refused") + stack.frontend.find("request_plane_refused")
        channels = len(fleet.generates)
        alive = stack.alive()
    finally:
        live = stack.close()
        fleet.close()
    limit_note = (
        f"open files {limits[0]['open_files']}, zmq max sockets {limits[0]['zmq_max_sockets']}"
        if limits
        else "no limits line"
    )
    suite.record(
        f"target: {announced} announced, {serving} serving with KV, {chats} chats: 5xx",
        float(five),
        "responses",
        "0",
        five == 0,
        f"{stack.added()} admitted in {converged:.1f} s, {followed:g} followed, {statuses(codes)}, "
        f"{channels} request-plane connections answered, {descriptors} descriptors open, "
        f"{len(refused)} refusal lines; {limit_note}; frontend alive: {alive}; {live}",
    )


SCENARIOS: dict[str, Callable[[Suite, Path], None]] = {
    "kv_publishers": kv_publishers,
    "round_robin": round_robin,
    "listeners": listeners,
    "thief": thief,
    "scale": scale,
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sockets", description=__doc__)
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only these")
    parser.add_argument("--suite", default="sockets", help="results/<suite>.json (e.g. sockets-before)")
    args = parser.parse_args()
    suite = Suite(args.suite)
    with tempfile.TemporaryDirectory(prefix="bench-sockets-") as tmp:
        for name in args.only or list(SCENARIOS):
            SCENARIOS[name](suite, Path(tmp))
    print(f"wrote {suite.write()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
