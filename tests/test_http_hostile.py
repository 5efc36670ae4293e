"""Hostile HTTP clients against a real frontend process, over real sockets: slow headers
(slowloris), a slow body, and a client that leaves mid-upload.

The frontend runs as its own process (as in production), so the many slow connections of this
test cannot starve it of anything but what they send."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

DEMO = "kimi-k3-demo"
SLOW_CONNECTIONS = 200
CHAT = json.dumps({"model": DEMO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()


@pytest.fixture(scope="module")
def frontend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DynamoProcess, int]]:
    port, discovery = free_port(), tcp_endpoint()
    proc = start_dynamo(
        "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
        "--model-path", DEMO, "--cache-dir", str(tmp_path_factory.mktemp("cache")),
        "--http-header-timeout", "2", "--http-body-timeout", "2",
        log_level="info",
    )  # fmt: skip
    worker = start_dynamo(
        "worker", "--model-path", DEMO, "--discovery", discovery, "--token-delay", "0", log_level="info"
    )
    try:
        proc.wait_event("model_added", timeout=30)
        yield proc, port
    finally:
        worker.stop()
        assert proc.stop() == 0


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one response that ends the connection or states its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        None,
    )
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body


def request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    with connect(port) as sock:
        head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        return read_response(sock)


def unanswered(sock: socket.socket) -> bool:
    """Open, and nothing received yet."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
        sock.settimeout(10)
    return False


def failures(proc: DynamoProcess, **fields: Any) -> list[dict[str, Any]]:
    return proc.find("request_failed", **fields)


def test_slow_header_clients_do_not_lock_anyone_out(frontend: tuple[DynamoProcess, int]) -> None:
    proc, port = frontend
    request_line = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nuser-agent: slowloris\r\n"
    slow = [connect(port) for _ in range(SLOW_CONNECTIONS)]
    try:
        for sock in slow:
            sock.sendall(request_line[:1])
        # Everyone else is still served, while every slow connection is open and unanswered.
        assert request(port, "GET", "/live")[0] == 200
        status, body = request(port, "POST", "/v1/chat/completions", CHAT)
        assert status == 200, body
        assert all(unanswered(sock) for sock in slow)  # nobody had to wait out their deadline
        # The slow ones trickle on, one byte each, and are cut off at the header deadline with a 408.
        for index in range(1, 6):
            for sock in slow:
                sock.sendall(request_line[index : index + 1])
        for sock in slow:
            status, _ = read_response(sock)
            assert status == 408
            assert sock.recv(1024) == b""  # and closed
    finally:
        for sock in slow:
            sock.close()
    assert request(port, "GET", "/live")[0] == 200
    wait_for(lambda: proc.find("http_header_timeout"), message="http_header_timeout logged")


def test_a_slow_body_gets_408(frontend: tuple[DynamoProcess, int]) -> None:
    proc, port = frontend
    with connect(port) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(head + f"content-length: {len(CHAT)}\r\nx-request-id: slow-body\r\n\r\n".encode())
        sock.sendall(CHAT[:10])
        status, body = read_response(sock)
    assert status == 408
    assert json.loads(body)["error"]["code"] == 408
    wait_for(lambda: failures(proc, request_id="slow-body", status=408), message="request_failed 408")


def test_a_client_leaving_mid_upload_is_499_never_500(frontend: tuple[DynamoProcess, int]) -> None:
    proc, port = frontend
    for index in range(5):
        with connect(port) as sock:
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            headers = f"content-length: {len(CHAT)}\r\nx-request-id: gone-{index}\r\n\r\n".encode()
            sock.sendall(head + headers + CHAT[: len(CHAT) // 2])
    for index in range(5):
        line = wait_for(lambda i=index: failures(proc, request_id=f"gone-{i}"), message=f"gone-{index}")[0]
        assert line["status"] == 499
        assert line["level"] == "info"
    assert not proc.find("request_crashed")
    assert not [event for event in proc.find("request_failed") if event["status"] >= 500]
    assert request(port, "POST", "/v1/chat/completions", CHAT)[0] == 200
