"""``dynamo-prep frontend --http-workers 2``: two whole frontends on one port, supervised.

Real processes: the supervisor, its two children (SO_REUSEPORT) and a mock worker announcing on
the embedded plane the supervisor forwards. Requests on fresh connections reach both children;
``/metrics`` from any child counts every child's requests; a child killed with SIGKILL is replaced
and serving goes on; SIGTERM to the supervisor stops everything with exit code 0."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import httpx
import pytest
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

DEMO = "kimi-k3-demo"
CHAT = {"model": DEMO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
TIMEOUT_S = 30.0


@pytest.fixture
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DynamoProcess, str]]:
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
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        worker.stop()
        proc.stop(timeout=20)


def chat_once(url: str) -> None:
    """One request on a connection of its own (the kernel picks a child per connection)."""
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, trust_env=False) as http:
        answer = http.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text


def served_ok(url: str) -> int:
    """``dynamo_frontend_requests_total`` for 200s, as one child reports it."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S, trust_env=False).text
    match = re.search(
        r'^dynamo_frontend_requests_total\{model="kimi-k3-demo",status="200"\} (\S+)$', text, re.M
    )
    return int(float(match.group(1))) if match else 0


def children(proc: DynamoProcess) -> dict[int, int]:
    """http_worker index -> its latest pid."""
    return {event["http_worker"]: event["pid"] for event in proc.find("http_worker_started")}


def test_two_children_serve_one_port_and_metrics_sum(workers: tuple[DynamoProcess, str]) -> None:
    proc, url = workers
    requests = 30
    for _ in range(requests):
        chat_once(url)
    finished = wait_for(
        lambda: len(proc.find("request_finished")) >= requests and proc.find("request_finished")
    )
    assert {event["http_worker"] for event in finished} == {0, 1}  # both processes served
    assert {served_ok(url) for _ in range(6)} == {requests}  # whichever child answers, all are counted


def test_a_killed_child_is_restarted_and_signals_stop_all(workers: tuple[DynamoProcess, str]) -> None:
    proc, url = workers
    before = children(proc)
    assert len(before) == 2
    chat_once(url)
    os.kill(before[0], signal.SIGKILL)
    exited = proc.wait_event("http_worker_exited", timeout=TIMEOUT_S, http_worker=0)
    assert exited["exit_code"] == -signal.SIGKILL
    wait_for(lambda: children(proc)[0] != before[0], TIMEOUT_S, message="child 0 restarted")
    wait_for(lambda: len(proc.find("model_added")) >= 3, TIMEOUT_S, message="restarted child serving")
    for _ in range(10):
        chat_once(url)
    assert served_ok(url) == 11  # the dead child's count is kept
    proc.terminate()
    assert proc.wait(TIMEOUT_S) == 0
    proc.wait_event("frontend_workers_stopped", exit_code=0)
    for pid in children(proc).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
