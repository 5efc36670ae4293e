"""Every frontend and worker metric moves when it should: a real ``dynamo-prep frontend`` process,
real mock workers, real HTTP requests, and ``/metrics`` scraped and parsed like Prometheus does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from support.images import png_data_url
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.frontend.metrics import MAX_MODEL_LABELS, OTHER_MODELS, UNKNOWN_MODEL, FrontendMetrics
from dynamo_prep.protocol.discovery import topic

DEMO = "kimi-k3-demo"
ODD = "odd-demo"
IMAGE = {"type": "image_url", "image_url": {"url": png_data_url()}}  # a real picture: workers decode it
F = "dynamo_frontend_"
W = "dynamo_worker_"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``url``/metrics, parsed with prometheus_client's own parser."""
    response = httpx.get(f"{url}/metrics", timeout=10, trust_env=False)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def chat(model: str, *content: Any, text: str = "Hello there") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
    }


@dataclass
class Plane:
    tmp_path: Path
    port: int = field(default_factory=free_port)
    discovery: str = field(default_factory=tcp_endpoint)
    procs: list[DynamoProcess] = field(default_factory=list)
    frontend: DynamoProcess | None = None
    worker: DynamoProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_frontend(self) -> DynamoProcess:
        http = ("--http-host", "127.0.0.1", "--http-port", str(self.port))
        cache = ("--cache-dir", str(self.tmp_path / "cache"))
        self.frontend = self._start(
            "frontend", "--discovery-bind", self.discovery, *http, *cache, log_level="info"
        )
        self.frontend.wait_event("frontend_started", timeout=20)
        return self.frontend

    def start_worker(self, *extra: str) -> DynamoProcess:
        proc = self._start(
            "worker", "--model-path", DEMO, "--discovery", self.discovery, *extra, log_level="info"
        )
        proc.wait_event("worker_started", timeout=20)
        return proc

    def post(self, body: dict[str, Any], **headers: str) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=30, trust_env=False
        )

    def scrape(self) -> Samples:
        return scrape(self.url)

    def wait_metric(self, name: str, expected: float, **labels: str) -> Samples:
        def reached() -> Samples | None:
            samples = self.scrape()
            return samples if value(samples, name, **labels) == expected else None

        return wait_for(reached, 20, interval=0.05, message=f"{name}{labels} == {expected}")

    def _start(self, *args: str, log_level: str) -> DynamoProcess:
        proc = start_dynamo(*args, log_level=log_level)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def worker_metrics_url(worker: DynamoProcess) -> str:
    port = worker.wait_event("worker_metrics_started")["port"]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    cluster = Plane(tmp_path_factory.mktemp("metrics"))
    try:
        cluster.start_frontend()
        assert cluster.post(chat(DEMO)).status_code == 503  # nothing announced yet
        cluster.worker = cluster.start_worker("--token-delay", "0.02", "--metrics-port", "0")
        cluster.wait_metric(f"{F}discovery_instances", 1, model=DEMO)
        wait_for(
            lambda: DEMO in httpx.get(f"{cluster.url}/v1/models", trust_env=False).text, 20, message="model"
        )
        yield cluster
    finally:
        cluster.stop()


def test_request_counters_by_status(plane: Plane) -> None:
    before = plane.scrape()
    assert value(before, f"{F}requests_total", model="unknown", status="503") == 1  # from the fixture
    assert plane.post(chat(DEMO)).status_code == 200
    assert plane.post(chat(DEMO, {"type": "video", "url": "x"})).status_code == 400
    assert plane.post(chat("nope")).status_code == 404
    unknown = {"model": "unknown", "status": "404"}
    after = plane.wait_metric(
        f"{F}requests_total", value(before, f"{F}requests_total", **unknown) + 1, **unknown
    )
    for model, status in ((DEMO, "200"), (DEMO, "400")):
        delta = value(after, f"{F}requests_total", model=model, status=status) - value(
            before, f"{F}requests_total", model=model, status=status
        )
        assert delta == 1, (model, status)


def test_inflight_rises_during_a_slow_stream_and_returns_to_zero(plane: Plane) -> None:
    body = {**chat(DEMO, text="a rather long question to make the reply long"), "stream": True}
    with httpx.stream(
        "POST", f"{plane.url}/v1/chat/completions", json=body, timeout=30, trust_env=False
    ) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert value(plane.scrape(), f"{F}inflight_requests", model=DEMO) == 1
        rest = list(lines)
    assert [line for line in rest if line][-1] == "data: [DONE]"
    plane.wait_metric(f"{F}inflight_requests", 0, model=DEMO)


def test_histograms_count_each_request(plane: Plane) -> None:
    before = plane.scrape()
    answer = plane.post(chat(DEMO, IMAGE, IMAGE, text="two cats"))
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    after = plane.wait_metric(
        f"{F}request_duration_seconds_count",
        value(before, f"{F}request_duration_seconds_count", model=DEMO) + 1,
        model=DEMO,
    )

    def delta(name: str) -> float:
        return value(after, f"{F}{name}", model=DEMO) - value(before, f"{F}{name}", model=DEMO)

    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    assert delta("preprocess_duration_seconds_count") == 1
    assert delta("input_sequence_tokens_count") == 1
    assert delta("input_sequence_tokens_sum") == usage["prompt_tokens"]
    assert delta("output_sequence_tokens_sum") == usage["completion_tokens"]
    assert delta("image_parts_per_request_count") == 1
    assert delta("image_parts_per_request_sum") == 2


def test_discovery_gauges_legacy_and_conflict_counters(plane: Plane) -> None:
    before = plane.scrape()
    assert value(before, f"{F}discovery_models") == 1
    assert value(before, f"{F}discovery_messages_total", kind="announce") > 0
    # An old vLLM worker: it declares nothing (conflicts with the SGLang worker's token) and still
    # sends the legacy key.
    legacy = plane.start_worker("--flavor", "vllm", "--legacy-expands-image-pad-token")
    during = plane.wait_metric(f"{F}discovery_instances", 2, model=DEMO)
    assert (
        value(during, f"{F}legacy_card_downgrades_total") - value(before, f"{F}legacy_card_downgrades_total")
        == 1
    )
    conflicts = value(during, f"{F}runtime_config_conflicts_total") - value(
        before, f"{F}runtime_config_conflicts_total"
    )
    assert conflicts == 1  # image_placeholder_token differs
    legacy.terminate()
    after = plane.wait_metric(f"{F}discovery_instances", 1, model=DEMO)
    withdraws = value(after, f"{F}discovery_messages_total", kind="withdraw")
    assert withdraws - value(before, f"{F}discovery_messages_total", kind="withdraw") == 1
    assert value(after, f"{F}discovery_models") == 1


def test_rejected_counter_counts_garbage(plane: Plane) -> None:
    before = plane.scrape()
    name, labels = f"{F}discovery_rejected_total", {"reason": "invalid"}
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(plane.discovery)
    try:
        # A PUB drops what it sends before the connection is up: resend until the frontend counts one.
        def counted() -> bool:
            pub.send_multipart([topic("dynamo"), b"garbage"])
            return value(plane.scrape(), name, **labels) > value(before, name, **labels)

        wait_for(counted, 20, interval=0.05, message="a rejected garbage message")
    finally:
        pub.close(linger=0)
    after = plane.scrape()
    invalid = value(after, f"{F}discovery_messages_total", kind="invalid")
    assert invalid - value(before, f"{F}discovery_messages_total", kind="invalid") >= 1
    assert value(after, f"{F}discovery_instances", model=DEMO) == 1  # garbage changed nothing else


def test_unregistered_declared_token_and_worker_contract_violation(plane: Plane) -> None:
    """A worker declaring a token the tokenizer does not know: counted on the frontend when its
    model is built, and each image request it gets breaks the engine's contract (counted there)."""
    before = plane.scrape()
    odd = plane.start_worker(
        "--served-name",
        ODD,
        "--declare-image-token",
        "<|not_special|>",
        "--metrics-port",
        "0",
        "--token-delay",
        "0",
    )
    wait_for(lambda: ODD in httpx.get(f"{plane.url}/v1/models", trust_env=False).text, 20, message=ODD)
    name = f"{F}declared_image_token_unregistered_total"
    assert value(plane.scrape(), name) - value(before, name) == 1
    refused = plane.post(chat(ODD, IMAGE))
    assert refused.status_code == 400 and "image placeholder" in refused.text, refused.text
    worker = scrape(worker_metrics_url(odd))
    assert value(worker, f"{W}contract_violations_total", flavor="sglang") == 1
    assert value(worker, f"{W}requests_total", status="error_400") == 1
    assert value(worker, f"{W}generated_tokens_total") == 0


def test_worker_metrics_follow_its_requests(plane: Plane) -> None:
    assert plane.worker is not None
    url = worker_metrics_url(plane.worker)
    before = scrape(url)
    answer = plane.post({**chat(DEMO), "max_tokens": 5})
    assert answer.status_code == 200
    after = scrape(url)
    assert (
        value(after, f"{W}requests_total", status="length")
        - value(before, f"{W}requests_total", status="length")
        == 1
    )
    assert value(after, f"{W}generated_tokens_total") - value(before, f"{W}generated_tokens_total") == 5
    assert value(after, f"{W}inflight_requests") == 0
    assert value(after, f"{W}contract_violations_total", flavor="sglang") == 0
    assert json.loads(answer.text)["usage"]["completion_tokens"] == 5


def test_model_labels_are_capped_and_later_models_share_other() -> None:
    """Issue 13: a flood of announced names, each asked once, must not grow /metrics (nor the
    objects the garbage collector walks: a few hundred per model label) without bound."""
    metrics = FrontendMetrics()
    for index in range(MAX_MODEL_LABELS + 50):
        metrics.of(f"m{index}").requests(200).inc()
    metrics.of(UNKNOWN_MODEL).requests(404).inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    totals = {
        sample.labels["model"]: sample.value
        for sample in families["dynamo_frontend_requests"].samples
        if sample.name.endswith("_total")
    }
    assert len(totals) == MAX_MODEL_LABELS + 2
    assert totals[OTHER_MODELS] == 50 and totals[UNKNOWN_MODEL] == 1 and totals["m0"] == 1
    assert f"m{MAX_MODEL_LABELS}" not in totals
