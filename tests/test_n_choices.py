"""``n`` > 1 with the official ``openai`` client against a real frontend and mock workers: chat
choices streamed (interleaved, each with its index and its own finish, one ``[DONE]``) and not,
usage summed with the prompt counted once, each choice its own request on the request plane (the
workers see n requests), a client that leaves cancels all n, the bound on ``n`` (a 400 naming it),
and choice i's seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.cluster import Cluster, mock_cluster
from support.cluster import openai_client as client
from support.plane import DynamoProcess, wait_for

from dynamo_prep.frontend.choices import INT64_MAX, choice_seed
from dynamo_prep.preprocessor import MAX_N

QWEN = "qwen-vl-demo"
SLOW = "kimi-k3-demo"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two fast workers of the Qwen demo and one slow K3 worker (``procs[1:3]`` and ``procs[3]``)."""
    workers = [("--model-path", QWEN)] * 2 + [("--model-path", SLOW, "--token-delay", "0.05")]
    with mock_cluster(tmp_path_factory.mktemp("n"), workers, worker_log_level="debug") as running:
        yield running


def started(workers: list[DynamoProcess], request_id: str) -> list[dict[str, Any]]:
    """The workers' ``request_started`` lines of the HTTP request ``request_id`` (plane ids extend it)."""
    return [
        line
        for worker in workers
        for line in worker.find("request_started")
        if str(line.get("request_id", "")).startswith(f"{request_id}.")
    ]


def test_three_choices_each_its_own_request_with_usage_summed(cluster: Cluster) -> None:
    api = client(cluster)
    one = api.chat.completions.create(model=QWEN, messages=HELLO, max_tokens=200)  # type: ignore[arg-type]
    three = api.chat.completions.with_raw_response.create(
        model=QWEN, messages=HELLO, max_tokens=200, n=3, extra_headers={"x-request-id": "n-three"},  # type: ignore[arg-type]
    ).parse()  # fmt: skip
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    content = one.choices[0].message.content
    assert [choice.message.content for choice in three.choices] == [content] * 3
    assert all(choice.finish_reason == "stop" for choice in three.choices)
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    wait_for(lambda: len(started(cluster.procs[1:3], "n-three")) == 3, 10, message="three worker requests")
    ids = {line["request_id"] for line in started(cluster.procs[1:3], "n-three")}
    assert len(ids) == 3  # three requests on the plane, not one
    record = cluster.frontend.wait_event("request_finished", request_id="n-three")
    assert record["completion_tokens"] == three.usage.completion_tokens


def test_streamed_choices_interleave_each_with_its_finish_and_one_done(cluster: Cluster) -> None:
    api = client(cluster)
    whole = api.chat.completions.create(model=QWEN, messages=HELLO, max_tokens=200, n=3)  # type: ignore[arg-type]
    stream = api.chat.completions.create(
        model=QWEN, messages=HELLO, max_tokens=200, n=3, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts: dict[int, str] = {}
    roles: dict[int, int] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles[choice.index] = roles.get(choice.index, 0) + (choice.delta.role == "assistant")
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert roles == {0: 1, 1: 1, 2: 1} and finishes == {0: ["stop"], 1: ["stop"], 2: ["stop"]}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    raw = httpx.post(
        f"{cluster}/v1/chat/completions", trust_env=False, timeout=30,
        json={"model": QWEN, "messages": HELLO, "n": 3, "stream": True, "max_tokens": 200},
    )  # fmt: skip
    assert raw.text.count("data: [DONE]") == 1 and raw.text.endswith("data: [DONE]\n\n")


def test_n_one_is_unchanged(cluster: Cluster) -> None:
    answer = client(cluster).chat.completions.create(model=QWEN, messages=HELLO, n=1)  # type: ignore[arg-type]
    assert [choice.index for choice in answer.choices] == [0]


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_outside_its_bound_is_refused_naming_n(cluster: Cluster, n: int, path: str) -> None:
    body = {"model": QWEN, "n": n, "messages": HELLO, "prompt": "hi"}
    answer = httpx.post(f"{cluster}{path}", json=body, trust_env=False, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "n" and f"[1, {MAX_N}]" in error["message"]


def test_a_client_that_leaves_cancels_every_choice(cluster: Cluster) -> None:
    body = {"model": SLOW, "messages": HELLO, "n": 3, "stream": True, "max_tokens": 2000}
    with httpx.stream(
        "POST", f"{cluster}/v1/chat/completions", json=body, trust_env=False, timeout=30,
        headers={"x-request-id": "n-leaves"},
    ) as answer:  # fmt: skip
        assert answer.status_code == 200
        next(answer.iter_bytes())  # the stream started; then the client leaves
    wait_for(lambda: len(started([cluster.procs[3]], "n-leaves")) == 3, 10, message="three worker requests")

    def finished() -> list[dict[str, Any]]:
        lines = cluster.procs[3].find("request_finished")
        return [line for line in lines if str(line.get("request_id", "")).startswith("n-leaves.")]

    wait_for(lambda: len(finished()) == 3, 20, message="all three ended on the worker")
    assert {line["finish_reason"] for line in finished()} == {"cancelled"}
    cluster.frontend.wait_event("request_failed", request_id="n-leaves", status=499)


def test_choice_i_gets_seed_plus_i() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    assert choice_seed(INT64_MAX, 2) == INT64_MAX - 2  # never past int64
