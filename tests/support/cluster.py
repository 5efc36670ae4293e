"""A real frontend with real mock workers on loopback, and the official openai client pointed at it:
the cluster every OpenAI-surface suite talks to (``make up``'s kind of cluster)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

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


def _served(flags: Sequence[str]) -> str:
    """The model a worker serves: its ``--served-name``, else its ``--model-path``."""
    name = "--served-name" if "--served-name" in flags else "--model-path"
    return flags[list(flags).index(name) + 1]


def openai_client(url: str, *, timeout: float = 30) -> openai.OpenAI:
    """The official client for ``url`` (no retries: a test sees the first answer)."""
    http = httpx.Client(trust_env=False, timeout=timeout)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=http)
