"""A real frontend with real mock workers on loopback, and the official openai client pointed at it:
the cluster every OpenAI-surface suite talks to (``make up``'s kind of cluster); and ``Processes``,
the cluster a fault test starts one process at a time, to kill, freeze or restart them."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import openai

from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

READY_S = 120.0
"""How long the workers may take to be added: a worker of a Hugging Face checkpoint loads its tokenizer
(seconds on an idle core), and several start at once on 2 loaded cores."""


class Cluster(str):
    """The frontend's base URL (what the tests talk to), with its processes beside it."""

    frontend: DynamoProcess
    discovery: str
    procs: list[DynamoProcess]


@contextlib.contextmanager
def mock_cluster(
    directory: Path,
    workers: Sequence[Sequence[str]],
    *,
    frontend_args: Sequence[str] = (),
    log_level: str = "info",
    worker_log_level: str = "info",
    ready_timeout_s: float = READY_S,
) -> Iterator[Cluster]:
    """A frontend on a plane of its own and one mock worker per entry of ``workers`` (each entry the
    worker's flags; ``--discovery`` is added, and ``--token-delay 0`` unless the entry has one);
    yielded once every worker's instance and every model is added (``ready_timeout_s``: the deadline
    of each; large vocabularies take longer to load)."""
    port, discovery = free_port(), tcp_endpoint()
    procs: list[DynamoProcess] = []
    try:
        frontend = start_dynamo(
            "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
            "--cache-dir", str(directory / "cache"), *frontend_args, log_level=log_level,
        )  # fmt: skip
        procs.append(frontend)
        for flags in workers:
            delay = () if "--token-delay" in flags else ("--token-delay", "0")
            args = (*flags, "--discovery", discovery, *delay)
            procs.append(start_dynamo("worker", *args, log_level=worker_log_level))
        models = {_served(flags) for flags in workers}
        ready = ready_timeout_s
        wait_for(lambda: len(frontend.find("instance_added")) >= len(workers), ready, message="the workers")
        wait_for(lambda: len(frontend.find("model_added")) >= len(models), ready, message="every model added")
        cluster = Cluster(f"http://127.0.0.1:{port}")
        cluster.frontend, cluster.discovery, cluster.procs = frontend, discovery, procs
        yield cluster
    finally:
        for proc in reversed(procs):
            proc.stop()


@dataclass
class Processes:
    """One test's processes, started one at a time: a frontend (HTTP on ``port``, binding
    ``discovery``), workers, brokers; on exit every one is stopped, latest first. ``log_level``:
    each process's, unless its start names another."""

    tmp_path: Path
    log_level: str = "info"
    port: int = field(default_factory=free_port)
    discovery: str = field(default_factory=tcp_endpoint)
    procs: list[DynamoProcess] = field(default_factory=list)
    frontend: DynamoProcess | None = None
    """The latest frontend started."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *args: str, log_level: str | None = None) -> DynamoProcess:
        """``dynamo-prep ARGS``, stopped on exit."""
        proc = start_dynamo(*args, log_level=log_level or self.log_level)
        self.procs.append(proc)
        return proc

    def start_frontend(
        self, *flags: str, plane: Sequence[str] = (), log_level: str | None = None
    ) -> DynamoProcess:
        """A frontend on ``port`` binding ``discovery`` (``plane``: other discovery flags instead),
        once started; ``flags``: more of its options."""
        self.frontend = self.start(
            "frontend", *(plane or ("--discovery-bind", self.discovery)), "--http-host", "127.0.0.1",
            "--http-port", str(self.port), "--cache-dir", str(self.tmp_path / "cache"), *flags,
            log_level=log_level,
        )  # fmt: skip
        self.frontend.wait_event("frontend_started")
        return self.frontend

    def start_worker(self, *flags: str, discovery: str = "", log_level: str | None = None) -> DynamoProcess:
        """A worker with ``flags`` on ``discovery`` (by default the frontend's plane)."""
        return self.start("worker", "--discovery", discovery or self.discovery, *flags, log_level=log_level)

    def live(self, *workers: DynamoProcess) -> dict[str, DynamoProcess]:
        """``wait_live`` on the latest frontend."""
        assert self.frontend is not None
        return wait_live(self.frontend, workers)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.signal(signal.SIGCONT)  # a frozen process cannot handle SIGTERM
            proc.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def instance_id(worker: DynamoProcess) -> str:
    """The worker's instance id, once it has started."""
    value: str = worker.wait_event("worker_started")["instance_id"]
    return value


def wait_live(
    frontend: DynamoProcess, workers: Iterable[DynamoProcess], timeout: float = 30
) -> dict[str, DynamoProcess]:
    """Wait until ``frontend`` has built the model and added every worker's instance; instance id ->
    worker."""
    frontend.wait_event("model_added", timeout=timeout)
    by_id = {}
    for proc in workers:
        key = instance_id(proc)
        frontend.wait_event("instance_added", timeout=timeout, instance_id=key)
        by_id[key] = proc
    return by_id


@dataclass
class Streamed:
    """What a chat completions stream delivered: its content, in how many chunks, its error event, [DONE]."""

    text: str = ""
    chunks: int = 0
    error: dict[str, Any] | None = None
    done: bool = False


def stream_chat(
    http: httpx.Client, url: str, body: dict[str, Any], on_chunk: Callable[[int], None] = lambda _: None
) -> Streamed:
    """One chat completions stream of ``body`` read to ``[DONE]``; ``on_chunk(n)`` runs after the n-th
    non-empty content chunk."""
    result = Streamed()
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                result.error = event["error"]
                continue
            piece = event["choices"][0]["delta"].get("content") if event["choices"] else None
            if piece:
                result.text += piece
                result.chunks += 1
                on_chunk(result.chunks)
    return result


def _served(flags: Sequence[str]) -> str:
    """The model a worker serves: its ``--served-name``, else its ``--model-path``."""
    name = "--served-name" if "--served-name" in flags else "--model-path"
    return flags[list(flags).index(name) + 1]


def openai_client(url: str, *, timeout: float = 30) -> openai.OpenAI:
    """The official client for ``url`` (no retries: a test sees the first answer)."""
    http = httpx.Client(trust_env=False, timeout=timeout)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=http)
