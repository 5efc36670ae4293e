"""Test helpers for real sockets and real ``dynamo-prep`` processes on 127.0.0.1.

Everything here waits on conditions with deadlines (``wait_for``), never on sleeps, and every
process or socket it creates can be closed idempotently, so a failing test leaves nothing behind.

* ``free_port()`` / ``tcp_endpoint()``: a loopback port nobody listens on right now.
* ``wait_for(predicate, timeout)``: poll until the predicate returns something truthy.
* ``DynamoProcess`` / ``start_dynamo(...)``: a ``dynamo-prep`` subprocess whose JSON log lines
  (stdout) are parsed by a background thread into ``.events``; ``wait_event("worker_started")``.
* ``SubCollector``: a SUB socket owned by a background thread (bound or connected), collecting
  every discovery message with the CURVE ``User-Id`` of its sender; ``wait_messages(...)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import zmq

from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.discovery import (
    DEFAULT_NAMESPACE,
    Announce,
    DiscoveryMessage,
    decode_message,
    topic,
)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0  # a deadline, not a wait: generous, for 2 slow cores shared with other work
POLL_INTERVAL_S = 0.01


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it), never one handed out
    before in this process: the OS may give the same port to two probes in a row."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def tcp_endpoint(port: int | None = None) -> str:
    """``tcp://127.0.0.1:PORT`` for ``port`` or a free one."""
    return f"tcp://127.0.0.1:{port if port is not None else free_port()}"


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    interval: float = POLL_INTERVAL_S,
    message: str | Callable[[], str] = "condition",
) -> T:
    """The first truthy value of ``predicate()``; ``AssertionError`` naming ``message`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {text}")
        time.sleep(interval)  # polling interval of the condition, not a synchronisation


# --- processes ----------------------------------------------------------------------------------


@dataclass
class DynamoProcess:
    """A running ``dynamo-prep`` subprocess and the JSON log lines it printed so far.

    Non-JSON stdout lines are kept in ``.raw``; stderr is captured in ``.stderr_lines``.
    """

    args: list[str]
    process: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    stderr_lines: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def find(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        """Every logged event named ``event`` whose fields include ``fields``."""
        return [e for e in self.snapshot() if e.get("event") == event and _matches(e, fields)]

    def wait_event(self, event: str, timeout: float = DEFAULT_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """The first ``event`` with ``fields``; fails early (with the log) if the process exits first."""

        def found() -> dict[str, Any] | None:
            hits = self.find(event, **fields)
            if hits:
                return hits[0]
            if self.process.poll() is not None:
                self.join_readers()
                hits = self.find(event, **fields)
                if hits:
                    return hits[0]
                raise AssertionError(
                    f"process exited ({self.process.returncode}) before {event}: {self.tail()}"
                )
            return None

        return wait_for(found, timeout, message=lambda: f"{event} {fields} in {self.tail()}")

    def tail(self, lines: int = 20) -> str:
        with self._lock:
            out = (
                [json.dumps(e) for e in self.events[-lines:]] + self.raw[-lines:] + self.stderr_lines[-lines:]
            )
        return "\n".join(out)

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL (no withdraw, no cleanup) and reap."""
        self.signal(signal.SIGKILL)
        self.wait(DEFAULT_TIMEOUT_S)

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """The exit code; kills and reaps the process if it does not exit within ``timeout``."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"process did not exit within {timeout}s: {self.tail()}") from None
        self.join_readers()
        return code

    def stop(self, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """SIGTERM, then wait (SIGKILL after ``timeout``); always reaps. Idempotent."""
        self.terminate()
        with contextlib.suppress(AssertionError):
            return self.wait(timeout)
        return self.process.returncode

    def join_readers(self, timeout: float = 5.0) -> None:
        for reader in self._readers:
            reader.join(timeout)

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._add(line.rstrip("\n"))

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._lock:
                self.stderr_lines.append(line.rstrip("\n"))

    def _add(self, line: str) -> None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            event = None
        with self._lock:
            if isinstance(event, dict):
                self.events.append(event)
            else:
                self.raw.append(line)


def start_dynamo(
    *args: str,
    env: Mapping[str, str] | None = None,
    log_level: str = "debug",
    cwd: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> DynamoProcess:
    """Start ``python -m dynamo_prep.cli --log-level LEVEL ARGS...`` with JSON logs on stdout
    (``preexec_fn`` runs in the child before it starts: resource limits, say)."""
    command = [
        sys.executable,
        "-m",
        "dynamo_prep.cli",
        "--log-level",
        log_level,
        "--log-format",
        "json",
        *args,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
        preexec_fn=preexec_fn,  # noqa: PLW1509 - only setrlimit, no threads involved
    )
    proc = DynamoProcess(args=command, process=process)
    for target in (proc._read_stdout, proc._read_stderr):
        reader = threading.Thread(target=target, daemon=True)
        reader.start()
        proc._readers.append(reader)
    return proc


@contextlib.contextmanager
def dynamo_process(*args: str, **kwargs: Any) -> Any:
    """``with dynamo_process("worker", ...) as proc:``; the process is stopped and reaped on exit."""
    proc = start_dynamo(*args, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()


def _matches(event: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    return all(event.get(key) == value for key, value in fields.items())


# --- discovery sockets --------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One discovery message as a subscriber saw it."""

    topic: bytes
    payload: bytes
    user_id: str | None
    at: float  # time.monotonic() on receipt

    def decode(self) -> DiscoveryMessage:
        return decode_message(self.payload)


class SubCollector:
    """A SUB socket serviced by its own thread, collecting every message it receives.

    ``bind=True`` binds ``endpoint`` (a frontend's embedded plane); otherwise it connects (to a
    broker's XPUB). ``curve`` is a callable applied to the socket before bind/connect (e.g. to make
    it a CURVE server); pass ``context`` to share a ZAP authenticator's context.
    """

    def __init__(
        self,
        endpoints: str | Iterable[str],
        *,
        bind: bool = True,
        namespace: str = DEFAULT_NAMESPACE,
        context: zmq.Context[Any] | None = None,
        configure: Callable[[zmq.Socket[Any]], None] | None = None,
    ) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.messages: list[Received] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._context = context or zmq.Context.instance()
        self._prefix = topic(namespace)
        self._bind = bind
        self._configure = configure
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(DEFAULT_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"SubCollector failed to start: {self._error!r}")

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.messages)

    def decoded(self) -> list[DiscoveryMessage]:
        return [m.decode() for m in self.snapshot()]

    def wait_messages(
        self,
        predicate: Callable[[DiscoveryMessage], bool] = lambda m: True,
        count: int = 1,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> list[DiscoveryMessage]:
        """At least ``count`` decoded messages matching ``predicate`` (all of them, in order)."""

        def enough() -> list[DiscoveryMessage] | None:
            hits = [m for m in self.decoded() if predicate(m)]
            return hits if len(hits) >= count else None

        return wait_for(enough, timeout, message=lambda: f"{count} messages (have {len(self.snapshot())})")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEFAULT_TIMEOUT_S)

    def __enter__(self) -> SubCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            if self._configure is not None:
                self._configure(sub)
            sub.setsockopt(zmq.SUBSCRIBE, self._prefix)
            for endpoint in self.endpoints:
                (sub.bind if self._bind else sub.connect)(endpoint)
        except BaseException as exc:
            self._error = exc
            sub.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(20, zmq.POLLIN):  # short poll keeps the socket serviced
                    self._receive(sub)
        finally:
            sub.close(linger=0)

    def _receive(self, sub: zmq.Socket[Any]) -> None:
        frames = sub.recv_multipart(copy=False)
        user_id: str | None
        try:
            value = frames[0].get("User-Id")
            user_id = value if isinstance(value, str) else None
        except zmq.ZMQError:
            user_id = None
        received = Received(
            topic=frames[0].bytes,
            payload=frames[-1].bytes,
            user_id=user_id or None,
            at=time.monotonic(),
        )
        with self._lock:
            self.messages.append(received)


# --- model directories --------------------------------------------------------------------------


def write_model_dir(path: Path, *, chat_template: str | None = None, **config: Any) -> Path:
    """A servable model directory: the kimi-k3-demo tokenizer with its own config.json.

    ``config`` entries override the demo's config.json, so tests can make cards that differ.
    """
    path.mkdir(parents=True, exist_ok=True)
    demo = resolve_model_dir("kimi-k3-demo")
    values = {**json.loads((demo / "config.json").read_text()), **config}
    (path / "config.json").write_text(json.dumps(values))
    for name in ("tokenizer_config.json", "tiktoken.model", "generation_config.json"):
        shutil.copyfile(demo / name, path / name)
    if chat_template is not None:
        (path / "chat_template.jinja").write_text(chat_template)
    return path


def announces(message: DiscoveryMessage) -> bool:
    """A ``SubCollector`` filter: announcements only."""
    return isinstance(message, Announce)
