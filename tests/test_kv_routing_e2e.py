"""KV routing end to end, the way a peer does it: instances announced by raw pyzmq, the engines' own
KV-event wire published by hand (vLLM's map shape and the older array shape, int and bytes hashes),
a real ``dynamo-prep frontend --router-mode kv`` and real HTTP; routing read from its
``request_finished`` lines (``request_id`` is the ``x-request-id`` sent).

The raw instances share a real mock worker's request plane (the announce names any endpoint), so
every request is really served whichever instance the router picks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from support.kv_wire import RawKvPublisher, batch, removed, stored
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard, encode_card

K3 = "kimi-k3-demo"
BLOCK = 16  # the demo card's kv_cache_block_size
SYSTEM = "You are a meticulous assistant. " * 40  # a long shared prefix: many full blocks
TOPIC = b"kv-events"


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@dataclass
class Plane:
    """A frontend in kv mode, a real worker serving its request plane, and raw announces."""

    tmp_path: Path
    context: zmq.asyncio.Context
    procs: list[DynamoProcess]
    discovery: str = field(default_factory=tcp_endpoint)
    port: int = field(default_factory=free_port)
    frontend: DynamoProcess | None = None
    endpoint: str = ""
    seq: int = 0
    announcer: zmq.asyncio.Socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_frontend(self, *extra: str) -> DynamoProcess:
        self.frontend = start_dynamo(
            "frontend", "--discovery-bind", self.discovery, "--http-host", "127.0.0.1",
            "--http-port", str(self.port), "--router-mode", "kv", "--cache-dir", str(self.tmp_path / "cache"),
            *extra, log_level="info",
        )  # fmt: skip
        self.procs.append(self.frontend)
        self.frontend.wait_event("frontend_started", timeout=20)
        return self.frontend

    def start_worker(self, *extra: str) -> None:
        worker = start_dynamo(
            "worker", "--model-path", K3, "--discovery", self.discovery, "--token-delay", "0", *extra
        )
        self.procs.append(worker)
        self.endpoint = worker.wait_event("worker_started")["endpoint"]

    def announce(self, instance_id: str, publisher: RawKvPublisher) -> None:
        """An announce written by hand (wire v1 plus the ``kv_events`` key), as any peer would."""
        if self.announcer is None:
            self.announcer = self.context.socket(zmq.PUB)
            self.announcer.setsockopt(zmq.LINGER, 0)
            self.announcer.connect(self.discovery)
        self.seq += 1
        payload = {
            "v": 1,
            "kind": "announce",
            "instance_id": instance_id,
            "seq": self.seq,
            "sent_ms": int(time.time() * 1000),
            "ttl_ms": 60_000,
            "endpoint": self.endpoint,
            "card": msgspec.msgpack.decode(encode_card(ModelDeploymentCard.from_model_dir(K3))),
            "kv_events": {
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "topic": publisher.topic.decode(),
            },
        }
        self.announcer.send_multipart([b"dynamo_prep.v1.card.dynamo", msgspec.msgpack.encode(payload)])

    async def announced(self, instance_id: str, publisher: RawKvPublisher) -> None:
        """Announce until the frontend admits the instance and subscribes to its events."""
        assert self.frontend is not None
        deadline = time.monotonic() + 20
        while not self.frontend.find("instance_added", instance_id=instance_id):
            assert time.monotonic() < deadline, "the raw announce was never admitted"
            self.announce(instance_id, publisher)
            await asyncio.sleep(0.1)  # a heartbeat period (the slow joiner drops the first ones)
        # Admitted is not served yet: the model's build may still run (its requests would get a 503).
        await asyncio.to_thread(self.frontend.wait_event, "model_added", timeout=30, model=K3)
        await publisher.wait_subscribed()

    async def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            answer = await http.post(f"{self.url}/tokenize", json={"model": K3, "messages": messages})
        tokens: list[int] = answer.json()["tokens"]
        return tokens

    async def ask(self, messages: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
        """One chat completion; its ``request_finished`` line."""
        assert self.frontend is not None
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            answer = await http.post(
                f"{self.url}/v1/chat/completions",
                json={"model": K3, "messages": messages, "max_tokens": 8},
                headers={"x-request-id": request_id},
            )
        assert answer.status_code == 200, answer.text
        return await asyncio.to_thread(self.frontend.wait_event, "request_finished", request_id=request_id)

    async def applied(self, kind: str = "stored") -> float:
        """``dynamo_frontend_kv_blocks_applied_total{kind}``: blocks the index took from the events."""
        return await self.metric(f'dynamo_frontend_kv_blocks_applied_total{{kind="{kind}"}}')

    async def metric(self, name: str) -> float:
        """One series of the frontend's ``/metrics`` (0 when it is not there)."""
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            text = (await http.get(f"{self.url}/metrics")).text
        lines = [line for line in text.splitlines() if line.startswith(f"{name} ")]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


@pytest.fixture
async def plane(
    request: pytest.FixtureRequest, tmp_path: Path, context: zmq.asyncio.Context, procs: list[DynamoProcess]
) -> AsyncIterator[Plane]:
    """Parametrized indirectly, its parameter is more flags for the frontend, and the worker serving
    the request plane announces in another namespace: only the raw instances are routed to."""
    flags = getattr(request, "param", None)
    made = Plane(tmp_path, context, procs)
    made.start_frontend(*(flags or ()))
    made.start_worker(*(("--namespace", "unseen") if flags is not None else ()))
    try:
        yield made
    finally:
        if made.announcer is not None:
            made.announcer.close(linger=0)


def conversation(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def blocks_of(token_ids: list[int], count: int, *, first_hash: int, shape: str, kind: str) -> bytes:
    """A BlockStored batch of the first ``count`` full blocks of ``token_ids``, chained from the root."""
    hashes: list[Any] = [
        first_hash + i if kind == "int" else (first_hash + i).to_bytes(32, "big") for i in range(count)
    ]
    event = stored(hashes, None, block_size=BLOCK, shape=shape, tokens=token_ids[: count * BLOCK])  # type: ignore[arg-type]
    return batch([event])


async def test_vllm_events_from_raw_publishers_steer_each_request_to_its_cached_prefix(
    plane: Plane, context: zmq.asyncio.Context
) -> None:
    pubs = {name: RawKvPublisher(context, topic=TOPIC, replay=name == "raw-b") for name in ("raw-a", "raw-b")}
    try:
        for name, publisher in pubs.items():
            await plane.announced(name, publisher)
        first = conversation("What is the capital of France?")
        tokens = await plane.prompt_ids(first)
        full = len(tokens) // BLOCK
        # raw-b caches the whole prompt (current map shape, int hashes); raw-a only a third of it,
        # in the older positional shape with sha256-sized bytes hashes.
        pubs["raw-b"].publish(blocks_of(tokens, full, first_hash=1000, shape="map", kind="int"))
        pubs["raw-a"].publish(blocks_of(tokens, full // 3, first_hash=7, shape="array", kind="bytes"))
        await until_async(plane.applied, full + full // 3)
        line = await plane.ask(first, "kv-affinity-1")
        assert (line["instance_id"], line["kv_overlap_blocks"]) == ("raw-b", full)
        assert line["prompt_blocks"] == -(-len(tokens) // BLOCK)
        # raw-b evicts everything: the request now goes where a third of it is cached... or, since
        # no instance holds half the prompt, to the least loaded one: never to raw-b by overlap.
        pubs["raw-b"].publish(batch([removed([1000 + i for i in range(full)])]))
        await until_async(lambda: plane.applied("removed"), full)
        line = await plane.ask(first, "kv-affinity-2")
        assert line["kv_overlap_blocks"] in (0, full // 3)
    finally:
        for publisher in pubs.values():
            await publisher.close()


async def test_a_restarted_frontend_replays_the_cache_and_routes_by_overlap_at_once(
    plane: Plane, context: zmq.asyncio.Context
) -> None:
    publisher = RawKvPublisher(context, topic=TOPIC, replay=True)
    other = RawKvPublisher(context, topic=TOPIC, replay=True)
    try:
        await plane.announced("raw-cached", publisher)
        await plane.announced("raw-empty", other)
        messages = conversation("Tell me about tea.")
        tokens = await plane.prompt_ids(messages)
        full = len(tokens) // BLOCK
        publisher.publish(blocks_of(tokens, full, first_hash=50, shape="map", kind="bytes"))
        await until_async(plane.applied, full)
        assert plane.frontend is not None
        plane.frontend.kill()
        plane.start_frontend()  # same addresses: the raw announces reach it again
        plane.announcer = None  # a fresh PUB: the old one's subscription died with the frontend
        await plane.announced("raw-cached", publisher)
        await plane.announced("raw-empty", other)
        line = await plane.ask(messages, "kv-after-restart")  # no new event was published
        assert (line["instance_id"], line["kv_overlap_blocks"]) == ("raw-cached", full)
        assert publisher.requests and publisher.requests[-1] == 0  # it replayed from seq 0
    finally:
        await publisher.close()
        await other.close()


@pytest.mark.parametrize("plane", [("--kv-predict-ttl", "60")], indirect=True)
async def test_a_routed_prefix_counts_as_cached_on_its_instance_until_the_engines_events_say_otherwise(
    plane: Plane, context: zmq.asyncio.Context
) -> None:
    """The engines never publish the prompt: only the prediction of each routed request steers the
    next ones of its prefix (the old router spread them by its round-robin tie-break)."""
    pubs = {name: RawKvPublisher(context, topic=TOPIC) for name in ("raw-a", "raw-b")}
    try:
        for name, publisher in pubs.items():
            await plane.announced(name, publisher)
        first = await plane.ask(conversation("Where is the harbour?"), "predict-1")
        assert first["kv_overlap_blocks"] == 0
        holder = first["instance_id"]
        tokens = await plane.prompt_ids(conversation("Where is the harbour?"))
        shared = len(await plane.prompt_ids(conversation(""))) // BLOCK - 1  # the system prompt's
        for n, question in enumerate(("Where is the station?", "Where is the market?"), start=2):
            line = await plane.ask(conversation(question), f"predict-{n}")
            assert line["instance_id"] == holder and line["kv_overlap_blocks"] >= shared > 0
        assert await plane.metric("dynamo_frontend_kv_predicted_blocks") >= shared
        # The holder's engine stores the first blocks, then evicts them: its word wins, the blocks
        # predicted after them no longer count (nothing before them is cached).
        publisher, kept = pubs[holder], 4
        publisher.publish(blocks_of(tokens, kept, first_hash=500, shape="map", kind="int"))
        publisher.publish(batch([removed([500 + i for i in reversed(range(kept))])]))
        await until_async(lambda: plane.applied("removed"), kept)
        line = await plane.ask(conversation("Where is the harbour?"), "predict-after-removal")
        assert line["kv_overlap_blocks"] == 0
    finally:
        for publisher in pubs.values():
            await publisher.close()


@pytest.mark.parametrize("plane", [("--kv-predict-ttl", "0.2")], indirect=True)
async def test_predicted_blocks_expire_after_their_time_to_live(
    plane: Plane, context: zmq.asyncio.Context
) -> None:
    pubs = {name: RawKvPublisher(context, topic=TOPIC) for name in ("raw-a", "raw-b")}
    try:
        for name, publisher in pubs.items():
            await plane.announced(name, publisher)
        await plane.ask(conversation("Where is the harbour?"), "expire-1")
        deadline = time.monotonic() + 20
        while await plane.metric("dynamo_frontend_kv_predicted_blocks"):  # the gauge drops them
            assert time.monotonic() < deadline, "the predicted blocks never expired"
            await asyncio.sleep(0.05)
        line = await plane.ask(conversation("Where is the station?"), "expire-2")
        assert line["kv_overlap_blocks"] == 0
    finally:
        for publisher in pubs.values():
            await publisher.close()


async def until_async(read: Any, at_least: float, timeout: float = 20.0) -> None:
    """Wait until an async reading reaches ``at_least`` (the frontend applied what was published)."""
    deadline = time.monotonic() + timeout
    while (value := await read()) < at_least:
        assert time.monotonic() < deadline, f"reading stuck at {value} < {at_least}"
        await asyncio.sleep(0.05)
