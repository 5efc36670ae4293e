"""Tests against the real engines (``make test-engines``, a venv with vLLM); ``make test`` skips them.

``vllm_cluster`` is the cluster these tests share (started once, about a minute on 2 cores): a
real frontend with ``--router-mode kv`` and two ``dynamo-prep worker --engine vllm`` processes,
each running vLLM's CPU build on a tiny dummy-weight model (``scripts/make_engine_model.py``) and
publishing its own KV events. Everything is a real process on loopback; nothing is mocked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vLLM

REPO = Path(__file__).resolve().parents[2]
MODEL = "engmodel"
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
# What a real vLLM needs here (docs: the CPU recipe); the operator's flags, passed through unchanged.
VLLM_FLAGS = (
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--gpu-memory-utilization",
    "0.05",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-seqs",
    "16",
    "--seed",
    "0",  # the same dummy weights in every engine: greedy answers do not depend on routing
)
ENGINE_START_S = 300.0  # two engines loading at once on 2 slow cores
# Modules whose tests take the shared cluster's workers down: they run after every other test.
ENDS_THE_CLUSTER = ("test_vllm_shutdown.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The cluster's destroyers last, whatever the other modules are named."""
    items.sort(key=lambda item: item.path.name in ENDS_THE_CLUSTER)


def _engine_model_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "make_engine_model", REPO / "scripts" / "make_engine_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model directory, written by the repository's own script."""
    return Path(_engine_model_module().write_engine_model(tmp_path_factory.mktemp("models") / MODEL))


def kv_events_config(port: int, replay_port: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


def start_vllm_worker(
    model_dir: Path, discovery: str, *extra: str, drain_timeout_s: float = 30.0
) -> DynamoProcess:
    return start_dynamo(
        "worker",
        "--engine",
        "vllm",
        "--model-path",
        str(model_dir),
        "--discovery",
        discovery,
        "--metrics-port",
        "0",
        "--drain-timeout",
        str(drain_timeout_s),
        *VLLM_FLAGS,
        "--kv-events-config",
        kv_events_config(free_port(), free_port()),
        *extra,
        log_level="debug",
    )


@dataclass
class Worker:
    process: DynamoProcess
    instance_id: str
    metrics_url: str

    def metrics(self) -> dict[str, float]:
        """The worker's /metrics (its own and its engine's), as name{labels} -> value."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def metric(self, prefix: str) -> float:
        """The sum of every sample whose name{labels} starts with ``prefix``."""
        return sum(value for name, value in self.metrics().items() if name.startswith(prefix))


@dataclass
class Cluster:
    frontend: DynamoProcess
    workers: list[Worker]
    base_url: str
    discovery: str

    def worker(self, instance_id: str) -> Worker:
        return next(worker for worker in self.workers if worker.instance_id == instance_id)

    def client(self) -> openai.OpenAI:
        """The official openai client on the frontend (no retries: every failure shows)."""
        return openai.OpenAI(
            base_url=self.base_url,
            api_key="none",
            max_retries=0,
            timeout=120,
            http_client=httpx.Client(trust_env=False, timeout=120),
        )


def wait_serving(frontend: DynamoProcess, instance_id: str) -> None:
    """The instance is known and its model servable (built: /v1/models lists it)."""
    frontend.wait_event("instance_added", timeout=ENGINE_START_S, instance_id=instance_id)
    frontend.wait_event("model_added", timeout=ENGINE_START_S)


@pytest.fixture(scope="session")
def vllm_cluster(engine_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    discovery = tcp_endpoint()
    http_port = free_port()
    frontend = start_dynamo(
        "frontend",
        "--discovery-bind",
        discovery,
        "--http-port",
        str(http_port),
        "--cache-dir",
        str(tmp_path_factory.mktemp("cache")),
        "--router-mode",
        "kv",
        log_level="debug",
    )
    processes = [start_vllm_worker(engine_model, discovery) for _ in range(2)]
    try:
        frontend.wait_event("frontend_started", timeout=60)
        workers = []
        for process in processes:
            started = process.wait_event("worker_started", timeout=ENGINE_START_S)
            port = process.wait_event("worker_metrics_started", timeout=10)["port"]
            workers.append(Worker(process, started["instance_id"], f"http://127.0.0.1:{port}/metrics"))
            wait_serving(frontend, started["instance_id"])
        wait_for(lambda: len(frontend.find("kv_events_subscribed")) >= 2, 60, message="KV subscriptions")
        yield Cluster(frontend, workers, f"http://127.0.0.1:{http_port}/v1", discovery)
    finally:
        for process in processes:
            process.stop(timeout=60)
        frontend.stop(timeout=30)


def children(pid: int) -> list[int]:
    """Every process whose parent is ``pid`` (the engine's own processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found
