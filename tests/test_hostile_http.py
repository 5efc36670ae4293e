"""Hostile HTTP, round 2 (issue 20, rows 7, 8, 12), against real frontend processes over raw sockets.

Heads past their limits (an endless URL, an endless header, endless headers) are answered 414 /
431 and the connection is closed as soon as the limit is crossed: the attacker's own sender is cut
off long before it has sent what it meant to. Idle connections make room for newcomers (a client
past its cap loses its own longest idle connection, a full server its longest idle one), and when
every slot is busy the probes still get in. Attackers connect from 127.0.0.2 and up (Linux
loopback answers all of 127/8), so the legitimate client on 127.0.0.1 is another client to the
server. ``--http-workers`` children die with a supervisor killed -9, and ``/metrics`` shows live
children only."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.frontend.http_server import PROBE_PATHS, PROBE_RESERVE, ConnectionTable

DEMO = "kimi-k3-demo"
CHAT = {"model": DEMO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
TIMEOUT_S = 30.0
MAX_URL, MAX_HEAD, MAX_HEADERS = 1024, 4096, 20
MAX_CONNECTIONS, MAX_CLIENT = 48, 12
ENDLESS = 256 << 20  # what an endless head's sender means to send
# Far below ENDLESS, far above the limits plus both sockets' kernel buffers (32 MB + 4 MB here).
CUT_OFF = 96 << 20
GET = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"
ATTACKERS = [f"127.0.0.{index}" for index in range(2, 12)]


@pytest.fixture(scope="module")
def frontend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DynamoProcess, int]]:
    port, discovery = free_port(), tcp_endpoint()
    proc = start_dynamo(
        "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
        "--model-path", DEMO, "--cache-dir", str(tmp_path_factory.mktemp("cache")),
        "--http-header-timeout", "60",  # the heads here are cut by size, never by time
        "--http-max-url-bytes", str(MAX_URL), "--http-max-header-bytes", str(MAX_HEAD),
        "--http-max-headers", str(MAX_HEADERS), "--http-max-connections", str(MAX_CONNECTIONS),
        "--http-max-client-connections", str(MAX_CLIENT),
        log_level="info",
    )  # fmt: skip
    worker = start_dynamo(
        "worker", "--model-path", DEMO, "--discovery", discovery, "--token-delay", "0", log_level="info"
    )
    try:
        proc.wait_event("model_added", timeout=TIMEOUT_S)
        yield proc, port
    finally:
        worker.stop()
        assert proc.stop() == 0


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(TIMEOUT_S)
    sock.connect(("127.0.0.1", port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sent before it closed (a reset after its answer included)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def get(port: int, path: str, source: str = "127.0.0.1") -> bytes:
    """One GET on a connection of its own; the response (read up to its Content-Length)."""
    with connect(port, source) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        return read_response(sock)


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return data


def chat(port: int) -> httpx.Response:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S, trust_env=False) as http:
        return http.post("/v1/chat/completions", json=CHAT)


def counter(port: int, name: str, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S, trust_env=False).text
    match = re.search(rf'^dynamo_frontend_{name}_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (after any response it sent, which is drained)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(TIMEOUT_S)
    return True


# ----------------------------------------------------------------------------- heads (row 7)


@pytest.mark.parametrize(
    ("prefix", "filler", "status", "reason"),
    [
        (b"GET /v1/models?q=", b"a", 414, "url_too_long"),
        (GET + b"x-big: ", b"a", 431, "header_too_large"),
        (GET, b"x-many: " + b"a" * 90 + b"\r\n", 431, "too_many_headers"),
        (GET, b"x-big: " + b"a" * 1500 + b"\r\n", 431, "header_too_large"),
    ],
    ids=["url", "header-value", "many-headers", "big-headers"],
)  # fmt: skip
def test_an_endless_head_is_refused_at_its_limit_and_cut_off(
    frontend: tuple[DynamoProcess, int], prefix: bytes, filler: bytes, status: int, reason: str
) -> None:
    proc, port = frontend
    before = counter(port, "http_refused", reason)
    sent: list[int] = [0]
    with connect(port) as sock:

        def send() -> None:
            chunk = filler * max(1, (1 << 16) // len(filler))
            try:
                sock.sendall(prefix)
                while sent[0] < ENDLESS:
                    sock.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:  # the server closed: broken pipe, or reset
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        answer = read_until_closed(sock)
        sender.join(TIMEOUT_S)
    assert status_of(answer) == status, answer[:200]
    assert b"connection: close" in answer.lower()
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == status
    # The server stopped reading at the limit: the sender was cut off (it would have sent it all).
    assert not sender.is_alive()
    assert sent[0] < CUT_OFF
    assert counter(port, "http_refused", reason) == before + 1
    wait_for(lambda: proc.find("http_request_refused", reason=reason), message=f"{reason} logged")
    assert status_of(get(port, "/live")) == 200


def test_a_head_within_every_limit_is_served(frontend: tuple[DynamoProcess, int]) -> None:
    _, port = frontend
    url = "/live?q=" + "a" * (MAX_URL - len("/live?q="))
    headers = "".join(f"x-h{index}: {'b' * 100}\r\n" for index in range(MAX_HEADERS - 1))
    with connect(port) as sock:
        sock.sendall(f"GET {url} HTTP/1.1\r\nhost: x\r\n{headers}\r\n".encode())
        assert status_of(read_response(sock)) == 200


# ----------------------------------------------------------------------------- connections (row 8)


def idle_connections(port: int, sources: list[str], per_source: int) -> list[socket.socket]:
    """Keep-alive connections, each idle after one answered ``/live``, opened in order."""
    opened = []
    for source in sources:
        for _ in range(per_source):
            sock = connect(port, source)
            sock.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
            read_response(sock)
            opened.append(sock)
    return opened


def test_one_client_holds_at_most_its_cap_and_others_get_in(frontend: tuple[DynamoProcess, int]) -> None:
    _, port = frontend
    before = counter(port, "http_idle_closed", "client_connection_limit")
    flood = idle_connections(port, ATTACKERS[:1], 40)
    try:
        assert chat(port).status_code == 200
        assert status_of(get(port, "/live")) == 200
        # The client's longest idle connections made room for its newer ones: it keeps its cap.
        wait_for(lambda: sum(not is_closed(sock) for sock in flood) <= MAX_CLIENT, message="the cap")
        assert counter(port, "http_idle_closed", "client_connection_limit") > before
    finally:
        for sock in flood:
            sock.close()


def test_a_full_server_closes_the_longest_idle_connection_first(frontend: tuple[DynamoProcess, int]) -> None:
    _, port = frontend
    before = counter(port, "http_idle_closed", "connection_limit")
    flood = idle_connections(port, ATTACKERS[1:6], MAX_CLIENT)  # 60 connections, 48 slots
    try:
        assert chat(port).status_code == 200
        assert status_of(get(port, "/health")) == 200
        assert counter(port, "http_idle_closed", "connection_limit") > before

        def oldest_closed() -> bool:
            states = [is_closed(sock) for sock in flood]
            closed = states.count(True)
            return closed >= len(flood) - MAX_CONNECTIONS and states == [True] * closed + [False] * (
                len(flood) - closed
            )

        wait_for(oldest_closed, message="the longest idle connections closed, and only those")
    finally:
        for sock in flood:
            sock.close()


def test_the_probes_get_through_a_flood_of_busy_connections(frontend: tuple[DynamoProcess, int]) -> None:
    _, port = frontend
    busy = []
    try:
        for source in ATTACKERS[:5]:  # 60 connections inside a request head, every slot taken
            for _ in range(MAX_CLIENT):
                sock = connect(port, source)
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-slow: ")
                busy.append(sock)
        for path in PROBE_PATHS:
            assert status_of(get(port, path)) == 200
        answer = get(port, "/v1/models")
        # Admitted either in place of a connection whose first bytes were still on their way, or
        # past the limit for the probes only.
        if status_of(answer) != 200:
            assert status_of(answer) == 503
            assert b"only /live and /health are served" in answer
    finally:
        for sock in busy:
            sock.close()


class Conn:
    """What ``ConnectionTable`` asks of a connection."""

    def __init__(self) -> None:
        self.probes_only = False
        self.closed: str | None = None

    def close_idle(self, reason: str) -> None:
        self.closed = reason


def test_connection_table_order_and_reserve() -> None:
    table = ConnectionTable(max_connections=4, max_client_connections=2)
    a1, a2, a3, b1, c1, c2 = (Conn() for _ in range(6))
    admit: Any = table.admit
    assert admit(a1, "a") is None and admit(a2, "a") is None
    table.busy(a1)  # type: ignore[arg-type]
    assert admit(a3, "a") is None  # a's longest *idle* one makes room
    assert (a1.closed, a2.closed) == (None, "client_connection_limit")
    table.busy(a3)  # type: ignore[arg-type]
    assert admit(Conn(), "a") == "client_connection_limit"  # nothing of a's idle
    assert admit(b1, "b") is None and admit(c1, "c") is None
    assert table.open == 4
    assert admit(c2, "c") is None  # the server's longest idle one (b1) makes room
    assert b1.closed == "connection_limit"
    for conn in (c1, c2):
        table.busy(conn)  # type: ignore[arg-type]
    reserve = [Conn() for _ in range(PROBE_RESERVE)]
    for index, conn in enumerate(reserve):
        assert admit(conn, f"r{index}") is None
        table.busy(conn)  # type: ignore[arg-type] # an idle one would make room for the next
    assert all(conn.probes_only and conn.closed is None for conn in reserve) and table.full
    assert admit(Conn(), "late") == "connection_limit"
    for conn in [*reserve, a1, a3, c1, c2]:
        table.gone(conn)  # type: ignore[arg-type]
    assert table.open == 0


# ----------------------------------------------------------------------------- --http-workers (row 12)


@pytest.fixture
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DynamoProcess, int]]:
    port, discovery = free_port(), tcp_endpoint()
    proc = start_dynamo(
        "frontend", "--http-workers", "2", "--discovery-bind", discovery, "--http-host", "127.0.0.1",
        "--http-port", str(port), "--model-path", DEMO, "--cache-dir", str(tmp_path_factory.mktemp("cache")),
        log_level="info",
    )  # fmt: skip
    worker = start_dynamo(
        "worker", "--model-path", DEMO, "--discovery", discovery, "--token-delay", "0", log_level="info"
    )
    try:
        wait_for(lambda: len(proc.find("model_added")) >= 2, TIMEOUT_S, message=proc.tail)
        yield proc, port
    finally:
        worker.stop()
        for pid in children(proc).values():  # whatever the test did to their supervisor
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stop(timeout=20)


def children(proc: DynamoProcess) -> dict[int, int]:
    """http_worker index -> its latest pid."""
    return {event["http_worker"]: event["pid"] for event in proc.find("http_worker_started")}


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_children_die_with_a_supervisor_killed_9(workers: tuple[DynamoProcess, int]) -> None:
    proc, port = workers
    pids = list(children(proc).values())
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    proc.kill()
    proc.wait(TIMEOUT_S)
    wait_for(lambda: not any(alive(pid) for pid in pids), TIMEOUT_S, message="the children gone")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).close()  # nobody keeps the port


def test_metrics_show_live_children_only(workers: tuple[DynamoProcess, int]) -> None:
    proc, port = workers
    dead = children(proc)[0]
    os.kill(dead, signal.SIGKILL)
    proc.wait_event("http_worker_exited", timeout=TIMEOUT_S, http_worker=0)
    wait_for(lambda: children(proc)[0] != dead, TIMEOUT_S, message="child 0 restarted")
    wait_for(lambda: len(proc.find("model_added")) >= 3, TIMEOUT_S, message="restarted child serving")
    live = {str(pid) for pid in children(proc).values()}
    for _ in range(6):  # fresh connections: whichever child answers
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S, trust_env=False).text
        shown = set(re.findall(r'pid="(\d+)"', text))
        assert shown, text  # per-process gauges are there, labelled by pid
        assert shown <= live, (shown, live, dead)
