"""Logs for ops: each HTTP request ends with one ``request_finished`` / ``request_failed`` line that
carries the ``x-request-id`` the client got back; and every log event in the source is documented."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.plane import free_port, start_dynamo, tcp_endpoint

ROOT = Path(__file__).resolve().parent.parent
DEMO = "kimi-k3-demo"
# log.info("event", ...), self._log.warning(\n "event", ...), log.exception("event", ...)
LOG_CALL = re.compile(r"\b\w*log\.(?:debug|info|warning|error|exception|critical)\(\s*\"([a-z0-9_]+)\"")


class Frontend:
    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.discovery = tcp_endpoint()
        http = ("--http-host", "127.0.0.1", "--http-port", str(self.port), "--cache-dir", str(tmp_path))
        self.proc = start_dynamo("frontend", "--discovery-bind", self.discovery, *http, log_level="info")
        self.proc.wait_event("frontend_started", timeout=20)
        worker = ("--model-path", DEMO, "--discovery", self.discovery, "--token-delay", "0")
        self.worker = start_dynamo("worker", *worker, log_level="info")
        self.endpoint = self.worker.wait_event("worker_started", timeout=20)["endpoint"]
        self.proc.wait_event("model_added", timeout=20)

    def post(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        return httpx.post(url, json=body, headers=headers, timeout=30, trust_env=False)

    def stop(self) -> None:
        self.worker.stop()
        self.proc.stop()


@pytest.fixture(scope="module")
def frontend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    running = Frontend(tmp_path_factory.mktemp("logs"))
    try:
        yield running
    finally:
        running.stop()


def chat(model: str = DEMO, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi there"}], **extra}


def test_request_finished_carries_the_clients_request_id(frontend: Frontend) -> None:
    answer = frontend.post(chat(), {"x-request-id": "ops-check-1"})
    assert answer.status_code == 200
    assert answer.headers["x-request-id"] == "ops-check-1"
    line = frontend.proc.wait_event("request_finished", request_id="ops-check-1")
    usage = answer.json()["usage"]
    assert line["level"] == "info"
    assert line["model"] == DEMO and line["status"] == 200 and line["path"] == "/v1/chat/completions"
    assert line["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert line["completion_tokens"] == usage["completion_tokens"] > 0
    assert line["duration_ms"] > 0 and line["finish_reason"] == "stop"
    assert line["endpoint"] == frontend.endpoint


def test_a_generated_request_id_is_returned_and_logged_for_a_stream(frontend: Frontend) -> None:
    answer = frontend.post(chat(stream=True))
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    request_id = answer.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    line = frontend.proc.wait_event("request_finished", request_id=request_id)
    assert line["status"] == 200 and line["completion_tokens"] > 0
    assert line["endpoint"] == frontend.endpoint


def test_request_failed_carries_the_error(frontend: Frontend) -> None:
    answer = frontend.post(chat("nope"), {"x-request-id": "ops-check-404"})
    assert answer.status_code == 404 and answer.headers["x-request-id"] == "ops-check-404"
    line = frontend.proc.wait_event("request_failed", request_id="ops-check-404")
    assert line["status"] == 404 and line["model"] == "unknown"
    assert "does not exist" in line["error"]
    assert not frontend.proc.find("request_finished", request_id="ops-check-404")
    bad = frontend.post(chat(max_tokens=10**7), {"x-request-id": "ops-check-400"})
    assert bad.status_code == 400
    line = frontend.proc.wait_event("request_failed", request_id="ops-check-400")
    assert line["model"] == DEMO and "maximum context length" in line["error"]


def logged_events() -> dict[str, set[str]]:
    """Every event name passed to a structlog call in dynamo_prep/, with the files using it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "dynamo_prep").rglob("*.py"):
        for name in LOG_CALL.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_log_event_is_documented() -> None:
    events = logged_events()
    assert {"request_finished", "card_checksum_mismatch", "worker_metrics_started", "watch_started"} <= set(
        events
    )
    docs = "".join(
        (ROOT / "docs" / name).read_text(encoding="utf-8")
        for name in ("operations.md", "discovery.md", "kv-events.md")
    )
    missing = {name: sorted(files) for name, files in events.items() if f"`{name}`" not in docs}
    assert not missing, f"log events missing from docs/ (operations, discovery, kv-events): {missing}"


def test_log_call_pattern_sees_multiline_calls() -> None:
    source = (
        'log.info(\n    "one_event",\n    x=1,\n)\nself._log.warning("two_event")\nprint("not_an_event")\n'
    )
    assert LOG_CALL.findall(source) == ["one_event", "two_event"]
