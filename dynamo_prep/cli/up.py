"""``dynamo-prep up``: a whole local cluster in one command, for trying the project out.

It starts the frontend (embedded discovery plane, HTTP on ``--http-port``, KV routing) and two
mock workers of the demo model with a prefix cache publishing KV events, one enforcing SGLang's
image contract and one vLLM's, so the router's mixed pool is what you talk to: a new prompt goes
where there is room, a repeated one where its prefix is cached, and each reply says which flavor
served it. A third mock worker serves ``llama3-demo`` (a Llama-3.1-style directory with a real
``tokenizer.json``) declaring ``--tool-call-parser llama3_json``, for a Llama-3-style tool call.
The printed image request names a picture this process serves on 127.0.0.1, which the workers
fetch because they are started with ``--allowed-media-networks 127.0.0.1/32`` (a worker fetches
from public addresses only by default). Children are plain ``dynamo-prep`` processes whose
logs go to files (their directory is printed). Ctrl-C or SIGTERM stops the workers and the
frontend (SIGTERM, a grace period, then SIGKILL for stragglers) and exits 0.
"""

from __future__ import annotations

import http.server
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import structlog

from dynamo_prep.engines.registry import FLAVORS
from dynamo_prep.frontend.config import DEFAULT_HTTP_PORT
from dynamo_prep.lifecycle import EXIT_FAILED, EXIT_OK, on_stop_signals

__all__ = ["curl_command", "demo_png", "run_up", "structured_curl_command", "tool_curl_commands"]

log = structlog.get_logger("dynamo_prep.up")

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
POLL_S = 0.2
DEFAULT_UP_DISCOVERY = "tcp://127.0.0.1:7555"
DEFAULT_UP_MODEL = "kimi-k3-demo"
TOOLS_MODEL = "llama3-demo"
TOOLS_PARSER = "llama3_json"
DEFAULT_WATCH_ADDRESS = "tcp://127.0.0.1:7557"
DEMO_IMAGE_PATH = "/demo.png"
# The workers may fetch from this process's image server, and from nothing else that is not public.
UP_MEDIA_NETWORK = "127.0.0.1/32"
# Loopback only: an http_proxy in the environment must not see (or break) the readiness probe.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


def run_up(
    *,
    http_port: int = DEFAULT_HTTP_PORT,
    discovery_bind: str = DEFAULT_UP_DISCOVERY,
    model: str = DEFAULT_UP_MODEL,
    log_dir: Path | None = None,
    log_level: str = "info",
    watch_address: str = DEFAULT_WATCH_ADDRESS,
) -> int:
    """Start the cluster, wait until ``model`` is served, print how to use it, run until signalled."""
    stopping = threading.Event()

    def on_signal(signum: signal.Signals) -> None:
        log.info("up_stopping", signal=signum.name)
        stopping.set()

    with on_stop_signals(on_signal), _image_server() as image_url:
        return _run(stopping, http_port, discovery_bind, model, log_dir, log_level, watch_address, image_url)


def _run(  # noqa: PLR0917 - run_up's options, passed on once
    stopping: threading.Event,
    http_port: int,
    discovery_bind: str,
    model: str,
    log_dir: Path | None,
    log_level: str,
    watch_address: str,
    image_url: str,
) -> int:
    directory = log_dir or Path(tempfile.mkdtemp(prefix="dynamo-prep-up-"))
    directory.mkdir(parents=True, exist_ok=True)
    connect = _connect_address(discovery_bind)
    base_url = f"http://127.0.0.1:{http_port}"
    children: list[_Child] = []
    try:
        children.append(
            _start("frontend", directory, log_level, ["frontend", *_frontend_args(discovery_bind, http_port)])
        )
        # Workers also announce to the watch address: `dynamo-prep watch --bind` there sees them at
        # once (they re-announce on its subscription); nobody listening there costs nothing.
        announce_to = f"{connect},{watch_address}"
        for flavor in FLAVORS:
            worker = [
                "worker",
                "--model-path",
                model,
                "--discovery",
                announce_to,
                "--flavor",
                flavor,
                "--kv-events",
                "--allowed-media-networks",
                UP_MEDIA_NETWORK,
            ]
            children.append(_start(f"worker-{flavor}", directory, log_level, worker))
        tools_worker = ["worker", "--model-path", TOOLS_MODEL, "--discovery", announce_to]
        tools_worker += ["--kv-events", "--tool-call-parser", TOOLS_PARSER]
        children.append(_start("worker-llama3", directory, log_level, tools_worker))
        log.info("up_starting", url=base_url, model=model, tools_model=TOOLS_MODEL, log_dir=str(directory))
        served = _wait_ready(base_url, (model, TOOLS_MODEL), children, stopping)
        if served is None:
            return EXIT_OK if stopping.is_set() else EXIT_FAILED
        served_as, tools_as = served
        _print_banner(base_url, (served_as, tools_as), directory, watch_address, image_url)
        return _run_until_stopped(children, stopping)
    finally:
        _stop_all(children)
        log.info("up_stopped", log_dir=str(directory))


def _frontend_args(discovery_bind: str, http_port: int) -> list[str]:
    """The frontend of a local cluster: the embedded plane, and KV routing over its workers' caches."""
    return ["--discovery-bind", discovery_bind, "--http-port", str(http_port), "--router-mode", "kv"]


@contextmanager
def _image_server() -> Iterator[str]:
    """The demo picture served on 127.0.0.1 (a free port) while the cluster runs; its URL."""
    picture = demo_png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == DEMO_IMAGE_PATH
            body = picture if found else b"not found"
            self.send_response(200 if found else 404)
            self.send_header("content-type", "image/png" if found else "text/plain")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("up_image_served", request=format % args)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="up-image-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{DEMO_IMAGE_PATH}"
    finally:
        server.shutdown()
        server.server_close()


def demo_png(width: int = 64, height: int = 48) -> bytes:
    """A small RGBA PNG (a gradient with see-through stripes), encoded by hand: no imaging library."""
    rows = b"".join(
        b"\0"
        + bytes(value for x in range(width) for value in (x * 4, y * 5, 160, 0 if (x + y) % 16 < 4 else 255))
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def curl_command(base_url: str, model: str, image_url: str) -> str:
    """A ready-to-paste streaming chat request with one image."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 64,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": image_url}},
                ],
            }
        ],
    }
    return _curl(base_url, body, stream=True)


DEMO_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
DEMO_QUESTION = "What is the weather in Paris?"


def tool_curl_commands(base_url: str, model: str) -> tuple[str, str]:
    """A tool-calling exchange, ready to paste: the question (answered with a call of get_weather),
    then the conversation with the call and the tool's result (answered in plain text)."""
    call = {
        "id": "call_demo",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    question = {"role": "user", "content": DEMO_QUESTION}
    asked = {"model": model, "tools": [DEMO_TOOL], "messages": [question]}
    answered = {
        "model": model,
        "tools": [DEMO_TOOL],
        "messages": [
            question,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_demo", "content": "sunny, 21 C"},
        ],
    }
    return _curl(base_url, asked, stream=False), _curl(base_url, answered, stream=False)


DEMO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "sky": {"enum": ["sunny", "cloudy", "rainy"]},
        "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
    },
    "required": ["city", "sky", "celsius"],
    "additionalProperties": False,
}


def structured_curl_command(base_url: str, model: str) -> str:
    """A structured-output request, ready to paste: the answer is JSON valid under ``DEMO_SCHEMA``
    (docs/structured-outputs.md; the mock answers a minimal instance of the schema)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "The weather in Paris, as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": DEMO_SCHEMA, "strict": True},
        },
    }
    return _curl(base_url, body, stream=False)


def _curl(base_url: str, body: dict[str, Any], *, stream: bool) -> str:
    flags = "-sN" if stream else "-s"
    return (
        f"curl {flags} {base_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )


def _connect_address(bind: str) -> str:
    """Where workers connect for a bound address (a wildcard host means this machine)."""
    parts = urlsplit(bind)
    if parts.scheme != "tcp" or parts.port is None or parts.port == 0:
        raise SystemExit(f"--discovery-bind must be tcp://HOST:PORT with a fixed port, got {bind!r}")
    host = parts.hostname or "127.0.0.1"
    return f"tcp://{'127.0.0.1' if host in ('0.0.0.0', '*') else host}:{parts.port}"


def _start(name: str, directory: Path, log_level: str, args: list[str]) -> _Child:
    log_path = directory / f"{name}.log"
    log_file = log_path.open("ab")
    command = [sys.executable, "-m", "dynamo_prep.cli", "--log-level", log_level, *args]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log.info("up_child_started", child=name, pid=process.pid, log=str(log_path))
    return _Child(name, process, log_path, log_file)


def _wait_ready(
    base_url: str, models: tuple[str, ...], children: list[_Child], stopping: threading.Event
) -> tuple[str, ...] | None:
    """Poll ``/v1/models`` until each of ``models`` (or its directory's name) is listed; the names
    they are served as, or None on failure."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stopping.is_set():
        dead = _dead(children)
        if dead is not None:
            log.error(
                "up_child_exited", child=dead.name, code=dead.process.returncode, log=str(dead.log_path)
            )
            return None
        listed = _served_models(base_url)
        found = [next(iter({model, Path(model).name} & listed), None) for model in models]
        if all(found):
            return tuple(name for name in found if name)
        if time.monotonic() >= deadline:
            log.error("up_not_ready", url=base_url, timeout_s=READY_TIMEOUT_S)
            return None
        stopping.wait(POLL_S)  # a polling interval, woken at once by a stop signal
    return None


def _served_models(base_url: str) -> set[str]:
    try:
        with _NO_PROXY.open(f"{base_url}/v1/models", timeout=2) as response:
            body: dict[str, Any] = json.load(response)
    except (OSError, urllib.error.URLError, ValueError):
        return set()
    return {entry["id"] for entry in body.get("data", []) if isinstance(entry, dict) and "id" in entry}


def _print_banner(
    base_url: str, models: tuple[str, str], directory: Path, watch_address: str, image_url: str
) -> None:
    model, tools_model = models
    lines = [
        "",
        f"dynamo-prep is up: {base_url}  (model {model}; mock workers: {', '.join(FLAVORS)};"
        f" and {tools_model} with --tool-call-parser {TOOLS_PARSER})",
        f"logs: {directory}/{{frontend,worker-sglang,worker-vllm,worker-llama3}}.log",
        "Try (run it twice: the second run goes to the worker whose KV cache holds the prompt;",
        "the frontend log's request_finished says kv_overlap_blocks). The workers fetch the picture",
        f"from this process: they were started with --allowed-media-networks {UP_MEDIA_NETWORK}",
        "(by default a worker fetches from public addresses only):",
        "",
        curl_command(base_url, model, image_url),
        "",
        "A tool call (the mock calls the first tool a request declares, as a model would), then the",
        "answer once the tool has run (the call and its result sent back):",
        "",
        *tool_curl_commands(base_url, model),
        "",
        f"The same with {tools_model}, a Llama-3.1-style model (a real tokenizer.json vocabulary): its",
        f"worker declares --tool-call-parser {TOOLS_PARSER}, so the mock answers a call as Llama 3.1 does",
        '({"name": ..., "parameters": ...}) and the frontend reads it as vLLM\'s llama3_json parser does:',
        "",
        *tool_curl_commands(base_url, tools_model),
        "",
        "A structured output (the engine constrains the answer to the schema's JSON):",
        "",
        structured_curl_command(base_url, model),
        "",
        f"Watch the discovery plane live: dynamo-prep watch --bind {watch_address}",
        "Ctrl-C stops everything.",
        "",
    ]
    print("\n".join(lines), flush=True)


def _run_until_stopped(children: list[_Child], stopping: threading.Event) -> int:
    while not stopping.wait(POLL_S):
        dead = _dead(children)
        if dead is not None:
            log.error(
                "up_child_exited", child=dead.name, code=dead.process.returncode, log=str(dead.log_path)
            )
            return EXIT_FAILED
    return EXIT_OK


def _dead(children: list[_Child]) -> _Child | None:
    return next((child for child in children if child.process.poll() is not None), None)


def _stop_all(children: list[_Child]) -> None:
    """Workers first (they withdraw, then drain), then the frontend; SIGKILL after the grace period."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("up_child_killed", child=child.name, pid=child.process.pid)
            child.process.kill()
            child.process.wait()
        child.log_file.close()
