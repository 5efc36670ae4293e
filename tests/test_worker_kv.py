"""``dynamo-prep worker --engine mock --kv-events``: real worker processes, their KV events on the wire.

The client here speaks the engines' KV-event wire by hand (a SUB for ``[topic, seq, payload]``, a
DEALER for replays, payloads read as plain msgpack), so the worker is checked against vLLM's
format, not against the project's own decoder; the events are then fed to a real ``KvIndex``.
Pictures come from a server on loopback, which the worker may fetch from (``--allowed-media-networks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from support import kv_wire
from support.images import BLUE, RED, encoded, served_images
from support.kv_wire import END, be8
from support.logs import until
from support.plane import DynamoProcess, SubCollector, announces, start_dynamo, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import Announce, KvEventsEndpoint
from dynamo_prep.protocol.kv_events import decode_batch, image_spans
from dynamo_prep.protocol.preprocessed import (
    PreprocessedRequest,
    StopConditions,
    fetched_image_uuid,
    image_uuid,
)
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.tokenizer import Tokenizer

DEMO = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
BLOCK = 16  # the demo card's kv_cache_block_size
TIMEOUT_S = 10.0
PREAMBLE = " ".join(f"rule {n}: answer in plain words and cite the page you used." for n in range(8))
context = kv_wire.context  # fixture
PICTURES = {"/cat.png": encoded((6, 6), RED), "/dog.png": encoded((6, 6), BLUE)}
LOOPBACK_MEDIA = ("--allowed-media-networks", "127.0.0.1/32")


def preprocess(content: str | list[dict[str, Any]], *, preamble: str = PREAMBLE) -> PreprocessedRequest:
    """A K3 request rendered for the mock's default flavor (SGLang declares ``<|media_pad|>``)."""
    card = ModelDeploymentCard.from_model_dir(
        DEMO, runtime_config=ModelRuntimeConfig(image_placeholder_token=MEDIA_PAD)
    )
    messages = [{"role": "system", "content": preamble}, {"role": "user", "content": content}]
    return OpenAIPreprocessor.new(card, DEMO).preprocess({"model": DEMO, "messages": messages})


def warm_up(attempt: int) -> PreprocessedRequest:
    """A prompt of plain text: it shares no block with the chat prompts."""
    token_ids = Tokenizer.from_model_dir(DEMO).encode(f"warm up number {attempt}, " * 6)
    return PreprocessedRequest(model=DEMO, token_ids=token_ids, stop_conditions=StopConditions(max_tokens=4))


def pictured(url: str) -> PreprocessedRequest:
    image = {"type": "image_url", "image_url": {"url": url}}
    return preprocess([{"type": "text", "text": "Look."}, image, {"type": "text", "text": PREAMBLE}])


class RawKvClient:
    """A frontend's view of one worker's KV events, by hand: every live batch, and replays."""

    def __init__(self, context: zmq.asyncio.Context, kv: KvEventsEndpoint) -> None:
        assert kv.replay_endpoint is not None
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, kv.topic.encode())
        self.sub.connect(kv.endpoint)
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(kv.replay_endpoint)
        self.live: list[tuple[int, bytes]] = []  # (seq, payload) in arrival order
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        while True:
            _topic, seq, payload = await self.sub.recv_multipart()
            self.live.append((int.from_bytes(seq, "big"), payload))

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every batch the worker still buffers from ``start`` on, up to the end marker."""
        await self.dealer.send_multipart([b"", be8(start)])
        batches: list[tuple[int, bytes]] = []
        while True:
            frames = await asyncio.wait_for(self.dealer.recv_multipart(), TIMEOUT_S)
            empty, _topic, seq, payload = frames
            assert empty == b""
            if seq == END:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


def events_of(payload: bytes) -> list[dict[str, Any]]:
    """A batch as plain msgpack: ``[ts, [event maps], data_parallel_rank]``."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank is None
    return list(events)


def stored_of(batches: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    return [event for _, payload in batches for event in events_of(payload) if event["type"] == "BlockStored"]


def index_of(batches: list[tuple[int, bytes]], instance_id: str) -> KvIndex:
    index = KvIndex(BLOCK)
    for _, payload in batches:
        decoded = decode_batch(payload)
        assert decoded.skipped == []
        index.apply(instance_id, decoded.batch.events)
    assert index.counters.invalid_events == index.counters.unknown_parent_blocks == 0
    return index


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S, trust_env=False).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def plane() -> Iterator[tuple[str, SubCollector]]:
    address = tcp_endpoint()
    with SubCollector(address, bind=True) as collector:
        yield address, collector


@pytest.fixture
async def client() -> AsyncIterator[RequestPlaneClient]:
    client = RequestPlaneClient()
    yield client
    await client.close()


class KvWorker:
    """A worker process with ``--kv-events`` and what it announced."""

    def __init__(self, procs: list[DynamoProcess], plane: tuple[str, SubCollector], *extra: str) -> None:
        args = ("--model-path", DEMO, "--discovery", plane[0], "--token-delay", "0", "--kv-events", *extra)
        self.process = start_dynamo("worker", *args)
        procs.append(self.process)
        self.started = self.process.wait_event("worker_started")
        self.endpoint: str = self.started["endpoint"]
        self.instance_id: str = self.started["instance_id"]
        message = plane[1].wait_messages(announces)[0]
        assert isinstance(message, Announce) and message.instance_id == self.instance_id
        assert not isinstance(message.kv_events, msgspec.UnsetType)
        self.kv: KvEventsEndpoint = message.kv_events

    async def run(self, client: RequestPlaneClient, request: PreprocessedRequest, request_id: str) -> None:
        outputs = [
            o async for o in client.generate(self.endpoint, request, request_id=request_id, timeout_s=10)
        ]
        assert outputs[-1].finish_reason in ("stop", "length")

    def started_lines(self) -> list[dict[str, Any]]:
        return self.process.find("mock_generate_started")


async def test_a_kv_worker_publishes_its_cache_on_the_vllm_wire(
    plane: tuple[str, SubCollector],
    procs: list[DynamoProcess],
    context: zmq.asyncio.Context,
    client: RequestPlaneClient,
) -> None:
    media_pad_id = Tokenizer.from_model_dir(DEMO).special_tokens[MEDIA_PAD]
    worker = KvWorker(procs, plane, "--prefill-ms-per-1k", "100", "--metrics-port", "0", *LOOPBACK_MEDIA)
    assert worker.kv.endpoint.startswith("tcp://127.0.0.1:") and worker.kv.topic == ""
    assert worker.kv.replay_endpoint is not None and worker.kv.replay_endpoint.startswith("tcp://127.0.0.1:")
    assert (worker.started["kv_events"], worker.started["kv_replay_endpoint"]) == (
        worker.kv.endpoint,
        worker.kv.replay_endpoint,
    )
    raw = RawKvClient(context, worker.kv)
    try:
        # The SUB's subscription reaches the worker at some point: warm up until a batch arrives.
        for attempt in range(50):
            await worker.run(client, warm_up(attempt), f"warm-{attempt}")
            with contextlib.suppress(AssertionError):
                await until(lambda: raw.live, "a live batch", timeout=0.2)
                break
        assert raw.live, "no live batch after 50 warm-up requests"
        warm = len(raw.live)

        # A prompt's full blocks arrive live as one BlockStored, in the current (map) shape.
        request = preprocess("Summarise the rules above.")
        full = len(request.token_ids) // BLOCK
        await worker.run(client, request, "first")

        def roots() -> list[dict[str, Any]]:  # what warm-up blocks arrive later has a parent
            return [e for e in stored_of(raw.live[warm:]) if e["parent_block_hash"] is None]

        [stored] = await until(roots, "the prompt's BlockStored")
        assert set(stored) >= {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size"}
        assert stored["token_ids"] == request.token_ids[: full * BLOCK]
        assert stored["block_size"] == BLOCK and stored["parent_block_hash"] is None
        engine_hashes = stored["block_hashes"]
        assert len(engine_hashes) == full
        assert all(isinstance(h, bytes) and len(h) == 32 for h in engine_hashes)
        assert not set(engine_hashes) & set(request_block_hashes(request.token_ids, BLOCK))

        # The same prompt again is a cache hit, and its prefill is charged only for the rest.
        await worker.run(client, request, "second")
        first, second = worker.started_lines()[-2:]
        reused = (len(request.token_ids) - 1) // BLOCK * BLOCK  # at least one token is computed
        assert (first["cached_tokens"], second["cached_tokens"]) == (0, reused)
        assert first["prefill_ms"] == pytest.approx(len(request.token_ids) / 10, abs=0.01)
        assert 0 < second["prefill_ms"] < first["prefill_ms"]

        # Two prompts that differ only in an image: the image's block carries its identity.
        with served_images(PICTURES) as pictures:
            urls = {path: f"{pictures}{path}" for path in PICTURES}
            cat, dog = pictured(urls["/cat.png"]), pictured(urls["/dog.png"])
            start = cat.token_ids.index(media_pad_id)
            image_block = start // BLOCK
            await worker.run(client, cat, "cat")
            await worker.run(client, dog, "dog")
        last_seq = raw.live[-1][0]

        # Replay from 0: the whole history, in seq order, the same bytes as the live batches.
        history = await raw.replay(0)
        assert [seq for seq, _ in history] == list(range(len(history)))
        assert history[-1][0] >= last_seq
        assert all(history[seq] == (seq, payload) for seq, payload in raw.live)

        # An image's identity in the engine: its URL's uuid and its bytes' digest (docs/engines.md).
        pictured_stores = [e for e in stored_of(history) if e.get("extra_keys")]
        identities = [
            fetched_image_uuid(image_uuid(urls[path]), hashlib.sha256(PICTURES[path]).hexdigest())
            for path in ("/cat.png", "/dog.png")
        ]
        offset = start - image_block * BLOCK
        assert [e["extra_keys"][0] for e in pictured_stores] == [[[name, offset]] for name in identities]
        cat_store, dog_store = pictured_stores  # the dog shares the blocks before its image only
        assert dog_store["parent_block_hash"] == cat_store["parent_block_hash"] is not None
        assert dog_store["token_ids"] == cat_store["token_ids"]
        assert not set(dog_store["block_hashes"]) & set(cat_store["block_hashes"])
        image_start = image_block * BLOCK
        assert dog_store["token_ids"][:BLOCK] == dog.token_ids[image_start : image_start + BLOCK]

        # The frontend's own index, built from the events, finds the worker's blocks for each prompt.
        index = index_of(history, worker.instance_id)
        assert index.match(request_block_hashes(request.token_ids, BLOCK)) == {worker.instance_id: full}
        plain = index.match(request_block_hashes(dog.token_ids, BLOCK))  # images ignored: a text prefix
        assert plain == {worker.instance_id: image_block}
        # The router names the image by its URL (it never sees the bytes): the blocks still match.
        spans = image_spans(dog.token_ids, [media_pad_id], [image.uuid for image in dog.images])
        pictured_match = index.match(request_block_hashes(dog.token_ids, BLOCK, spans))
        assert pictured_match == {worker.instance_id: len(dog.token_ids) // BLOCK}

        metrics = scrape(worker.process.wait_event("worker_metrics_started")["port"])
        assert metrics["dynamo_worker_kv_cached_tokens_total"] == sum(
            line["cached_tokens"] for line in worker.started_lines()
        )
        assert metrics["dynamo_worker_prompt_tokens_total"] == sum(
            line["prompt_tokens"] for line in worker.started_lines()
        )
        assert metrics["dynamo_worker_kv_blocks"] == index.blocks_held(worker.instance_id)
    finally:
        await raw.close()

    # SIGTERM: withdraw, drain, then the KV publisher closes.
    worker.process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.process.wait, TIMEOUT_S) == 0
    order = [e["event"] for e in worker.process.snapshot()]
    assert order.index("card_withdrawn") < order.index("kv_publisher_closed") < order.index("worker_stopped")
    assert order.index("worker_draining") < order.index("kv_publisher_closed")


async def test_a_small_cache_evicts_least_recently_used_blocks(
    plane: tuple[str, SubCollector],
    procs: list[DynamoProcess],
    context: zmq.asyncio.Context,
    client: RequestPlaneClient,
) -> None:
    """``--kv-blocks`` bounds the cache: a new prompt evicts the blocks nobody uses any more."""
    first = preprocess("The first question.", preamble=PREAMBLE)
    second = preprocess("The second question.", preamble=PREAMBLE.upper())
    capacity = len(second.token_ids) // BLOCK + 4  # room for either prompt, not for both
    worker = KvWorker(procs, plane, "--kv-blocks", str(capacity))
    raw = RawKvClient(context, worker.kv)
    try:
        await worker.run(client, first, "first")
        await worker.run(client, second, "second")
        history = await raw.replay(0)
    finally:
        await raw.close()
    batches = [events_of(payload) for _, payload in history]
    evicting = next(i for i, batch in enumerate(batches) if any(e["type"] == "BlockRemoved" for e in batch))
    # Until the second prompt's admission evicts, every block stored is the first request's.
    first_blocks = {h for batch in batches[:evicting] for e in batch for h in e["block_hashes"]}
    removals = [e for batch in batches for e in batch if e["type"] == "BlockRemoved"]
    removed = [h for e in removals for h in e["block_hashes"]]
    assert removed and set(removed) <= first_blocks
    index = index_of(history, worker.instance_id)
    assert index.blocks_held(worker.instance_id) == capacity
    held_of_first = index.match(request_block_hashes(first.token_ids, BLOCK)).get(worker.instance_id, 0)
    assert 0 < held_of_first < len(first.token_ids) // BLOCK
    assert index.match(request_block_hashes(second.token_ids, BLOCK)) == {
        worker.instance_id: len(second.token_ids) // BLOCK
    }
