"""KV routing with real processes end to end: ``dynamo-prep worker --kv-events`` mock engines (a real
paged prefix cache publishing vLLM's wire) behind ``dynamo-prep frontend --router-mode kv``.

Affinity (a follow-up goes where its prefix is cached), spread (an unrelated prompt goes elsewhere),
images (the same text with another image shares blocks only up to the image), removal (a killed
worker's blocks leave the index), and two frontends that agree on every choice. Routing is read
from the frontends' ``request_finished`` lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.images import BLUE, RED, png_data_url
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint

K3 = "kimi-k3-demo"
PREAMBLE = "You are the archivist of a very old library; answer with care and cite shelves. " * 12
CAT = {"type": "image_url", "image_url": {"url": png_data_url(RED)}}  # real pictures: workers decode them
DOG = {"type": "image_url", "image_url": {"url": png_data_url(BLUE)}}


@dataclass
class Fleet:
    tmp_path: Path
    procs: list[DynamoProcess]
    planes: list[str] = field(default_factory=lambda: [tcp_endpoint(), tcp_endpoint()])
    watch_plane: str = field(default_factory=tcp_endpoint)  # for ``dynamo-prep watch --bind``
    frontends: list[tuple[DynamoProcess, str]] = field(default_factory=list)
    frontend_args: tuple[str, ...] = ()
    workers: dict[str, DynamoProcess] = field(default_factory=dict)  # instance_id -> process

    def frontend(self, plane: str) -> tuple[DynamoProcess, str]:
        port = free_port()
        proc = start_dynamo(
            "frontend", "--discovery-bind", plane, "--http-host", "127.0.0.1", "--http-port", str(port),
            "--router-mode", "kv", "--cache-dir", str(self.tmp_path / f"cache-{port}"), *self.frontend_args,
            log_level="info",
        )  # fmt: skip
        self.procs.append(proc)
        proc.wait_event("frontend_started", timeout=20)
        self.frontends.append((proc, f"http://127.0.0.1:{port}"))
        return proc, f"http://127.0.0.1:{port}"

    def worker(self, flavor: str, *, token_delay: float = 0, prefill_ms_per_1k: float = 0) -> str:
        args = (
            "--model-path", K3, "--discovery", ",".join([*self.planes, self.watch_plane]), "--flavor", flavor,
            "--token-delay", str(token_delay), "--kv-events", "--kv-blocks", "4096", "--heartbeat", "0.2",
            "--ttl-ms", "1000", "--prefill-ms-per-1k", str(prefill_ms_per_1k),
        )  # fmt: skip
        proc = start_dynamo("worker", *args, log_level="debug")
        self.procs.append(proc)
        instance_id: str = proc.wait_event("worker_started")["instance_id"]
        self.workers[instance_id] = proc
        for frontend, _ in self.frontends:
            frontend.wait_event("kv_events_subscribed", instance_id=instance_id, timeout=20)
        return instance_id


@pytest.fixture
def fleet(request: pytest.FixtureRequest, tmp_path: Path, procs: list[DynamoProcess]) -> Iterator[Fleet]:
    """Parametrized indirectly, its parameter is more flags for the frontends."""
    made = Fleet(tmp_path, procs, frontend_args=getattr(request, "param", ()))
    for plane in made.planes:
        made.frontend(plane)
    yield made


def ask(url: str, frontend: DynamoProcess, messages: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    with httpx.Client(trust_env=False, timeout=30) as http:
        answer = http.post(
            f"{url}/v1/chat/completions",
            json={"model": K3, "messages": messages, "max_tokens": 12},
            headers={"x-request-id": request_id},
        )
    assert answer.status_code == 200, answer.text
    return frontend.wait_event("request_finished", request_id=request_id)


def settled(url: str, what: str, at_least: float = 1) -> float:
    """Wait until the frontend's index applied what the workers stored so far: its applied-blocks
    counter is at least ``at_least`` and stopped moving. Returns the counter."""
    with httpx.Client(trust_env=False, timeout=30) as http:

        def applied() -> float:
            text = http.get(f"{url}/metrics").text
            prefix = 'dynamo_frontend_kv_blocks_applied_total{kind="stored"}'
            lines = [line for line in text.splitlines() if line.startswith(prefix)]
            return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

        last = -1.0
        deadline = time.monotonic() + 20
        while (now := applied()) != last or now < at_least:
            assert time.monotonic() < deadline, f"KV events missing at the frontend ({what}: {now})"
            last = now
            time.sleep(0.2)  # a quiet period: the publisher sends a batch per step
        return now


def conversation(question: str, *image: dict[str, Any]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [*image, {"type": "text", "text": question}]
    return [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": content}]


def test_affinity_spread_images_and_removal(fleet: Fleet) -> None:
    frontend, url = fleet.frontends[0]
    first, second = fleet.worker("sglang"), fleet.worker("sglang")
    start = ask(url, frontend, conversation("Where are the maps?"), "kv-start")
    settled(url, "start")
    again = ask(url, frontend, conversation("Where are the maps?"), "kv-again")
    assert again["instance_id"] == start["instance_id"]  # affinity: its whole prompt is cached there
    assert again["kv_overlap_blocks"] > 0 and 2 * again["kv_overlap_blocks"] >= again["prompt_blocks"]
    # An unrelated prompt (no shared preamble): nobody holds half of it, so it spreads to the other.
    other = ask(url, frontend, [{"role": "user", "content": "Count the stars in a jar. " * 30}], "kv-other")
    assert other["instance_id"] != start["instance_id"] and other["kv_overlap_blocks"] == 0

    # Images: the same text with another image shares blocks only up to the image.
    cat = ask(url, frontend, conversation("What animal is this?", CAT), "kv-cat")
    settled(url, "cat")
    cat_again = ask(url, frontend, conversation("What animal is this?", CAT), "kv-cat-again")
    dog = ask(url, frontend, conversation("What animal is this?", DOG), "kv-dog")
    assert cat_again["instance_id"] == cat["instance_id"]
    assert dog["kv_overlap_blocks"] < cat_again["kv_overlap_blocks"]

    # dynamo-prep watch follows the same events: the blocks each instance holds.
    watch = start_dynamo(
        "watch", "--bind", fleet.watch_plane, "--json", "--once-after", "3", log_level="info"
    )
    fleet.procs.append(watch)
    assert watch.wait(30) == 0
    rows = {row["instance_id"]: row for row in watch.find("snapshot")[0]["instances"]}
    assert rows[start["instance_id"]]["kv_blocks"] >= again["kv_overlap_blocks"] > 0

    # Removal: the worker holding the preamble dies; its blocks leave the index with it.
    holder = start["instance_id"]
    fleet.workers[holder].kill()
    frontend.wait_event("instance_removed", instance_id=holder, timeout=10)
    after = ask(url, frontend, conversation("Where are the maps?"), "kv-after-kill")
    assert after["instance_id"] in {first, second} - {holder}
    assert after["kv_overlap_blocks"] < again["kv_overlap_blocks"]


# What a frontend predicts from the requests it routed is its own: the indexes agree on the events.
@pytest.mark.parametrize("fleet", [("--kv-predict-ttl", "0")], indirect=True)
def test_two_frontends_build_the_same_index_and_agree(fleet: Fleet) -> None:
    (front_a, url_a), (front_b, url_b) = fleet.frontends
    fleet.worker("sglang")
    fleet.worker("vllm")
    prompts = [conversation(f"Shelf {index}, please.", *([CAT] if index % 2 else [])) for index in range(4)]
    applied = 0.0
    for index, messages in enumerate(prompts):  # warm both caches through frontend A only
        ask(url_a, front_a, messages, f"warm-{index}")
        applied = settled(url_a, f"warm-{index}")
    settled(url_b, "b", at_least=applied)  # B applied every block A did
    for index, messages in enumerate(prompts):
        on_a = ask(url_a, front_a, messages, f"agree-a-{index}")
        on_b = ask(url_b, front_b, messages, f"agree-b-{index}")
        assert (on_a["instance_id"], on_a["kv_overlap_blocks"]) == (
            on_b["instance_id"],
            on_b["kv_overlap_blocks"],
        )
        assert on_a["kv_overlap_blocks"] > 0


async def test_concurrent_requests_of_a_new_prefix_land_on_one_instance_and_other_prefixes_spread(
    fleet: Fleet,
) -> None:
    """Four conversations on each of two new preambles, all at once (the first preamble's four sent
    first), while the first of each is still prefilling (its instance's events may not have arrived
    yet): each preamble is computed on one instance, the two go to different ones. The old router
    sent the second request of a preamble to the idle instance (the first one's prefill and blocks
    counted as load against it)."""
    frontend, url = fleet.frontends[0]
    for flavor in ("sglang", "vllm"):
        fleet.worker(flavor, token_delay=0.05, prefill_ms_per_1k=400)
    preambles = {
        "maps": "You keep the maps of a very old library; answer with care and cite drawers. " * 12,
        "tea": "You brew tea for travellers at a mountain inn; name every leaf you use. " * 12,
    }

    async def one(http: httpx.AsyncClient, name: str, n: int) -> None:
        messages = [
            {"role": "system", "content": preambles[name]},
            {"role": "user", "content": f"Question {n} about {name}, please."},
        ]
        answer = await http.post(
            f"{url}/v1/chat/completions",
            json={"model": K3, "messages": messages, "max_tokens": 16},
            headers={"x-request-id": f"{name}-{n}"},
        )
        assert answer.status_code == 200, answer.text

    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        await asyncio.gather(*(one(http, name, n) for name in preambles for n in range(4)))
    placed = {
        name: {
            frontend.wait_event("request_finished", request_id=f"{name}-{n}")["instance_id"] for n in range(4)
        }
        for name in preambles
    }
    assert len(placed["maps"]) == len(placed["tea"]) == 1, placed
    assert placed["maps"] != placed["tea"]
