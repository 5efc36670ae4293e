"""The mock engine's prefix cache (in process): admission, prefill charge, release, images, and the
events read by the frontend's own index; and what a real engine's ``--kv-events-config`` advertises.

Requests are real preprocessed K3 prompts; events are what ``PagedPrefixCache`` emits through the
engine, recorded as they are published. The wire itself is tested with real worker processes in
``test_worker_kv.py``.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pytest
from support.logs import Logs, until
from support.plane import SubCollector, tcp_endpoint

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig, decode_card
from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.engines.kv_config import kv_events_endpoint
from dynamo_prep.engines.mock.engine import MockContinuation, MockEngine, MockOutput, Prefill
from dynamo_prep.engines.mock.kv import MockKvEngine, image_spans
from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.formatter.parts import image_uuid
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import Announce, KvEventsEndpoint
from dynamo_prep.protocol.kv_events import BlockRemoved, BlockStored, ImageSpan, KVEvent
from dynamo_prep.protocol.kv_events import placeholder_starts as occurrences
from dynamo_prep.protocol.preprocessed import PreprocessedRequest
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.worker.register import register

DEMO = "kimi-k3-demo"
BLOCK = 16
CAT = "https://example.com/cat.png"
DOG = "https://example.com/dog.png"
PREAMBLE = " ".join(f"rule {n}: answer in plain words and cite the page you used." for n in range(8))
TAIL = " ".join(f"then say what detail {n} of the picture shows." for n in range(6))


@pytest.fixture(scope="module")
def engines() -> dict[str, MockContinuation]:
    return {flavor: MockContinuation(MockEngine(DEMO, flavor=flavor)) for flavor in ("sglang", "vllm")}


def preprocess(flavor: str, content: str | list[dict[str, Any]], **fields: Any) -> PreprocessedRequest:
    """A real K3 request rendered for a worker of ``flavor`` (SGLang declares ``<|media_pad|>``)."""
    declared = "<|media_pad|>" if flavor == "sglang" else None
    card = ModelDeploymentCard.from_model_dir(
        DEMO, runtime_config=ModelRuntimeConfig(image_placeholder_token=declared)
    )
    messages = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": content}]
    return OpenAIPreprocessor.new(card, DEMO).preprocess({"model": DEMO, "messages": messages, **fields})


def pictured(flavor: str, url: str) -> PreprocessedRequest:
    return preprocess(
        flavor,
        [
            {"type": "text", "text": "Look at this picture."},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": TAIL},
        ],
    )


class Published:
    """The ``publish`` callable: every batch the engine publishes, in order."""

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []

    def __call__(self, events: Sequence[KVEvent]) -> None:
        self.batches.append(list(events))

    def events(self) -> list[KVEvent]:
        return [event for batch in self.batches for event in batch]

    def stored(self) -> list[BlockStored]:
        return [event for event in self.events() if isinstance(event, BlockStored)]


class Setup:
    """A ``MockKvEngine`` recording what it publishes and each admission's ``Prefill``."""

    def __init__(
        self,
        engine: MockContinuation,
        *,
        capacity: int = 256,
        prefill_ms_per_1k: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.published = Published()
        self.prefills: list[Prefill] = []
        self.cache = PagedPrefixCache(BLOCK, capacity, seed=b"worker-a")
        self.kv = MockKvEngine(
            engine,
            self.cache,
            self.published,
            prefill_ms_per_1k=prefill_ms_per_1k,
            on_admit=self.prefills.append,
            clock=clock,
        )

    async def run(self, request: PreprocessedRequest) -> list[MockOutput]:
        return [output async for output in self.kv.generate(request)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def reply_ids(outputs: list[MockOutput]) -> list[int]:
    return [token_id for output in outputs for token_id in output.token_ids]


def index_of(events: Sequence[KVEvent], instance_id: str = "worker-a") -> KvIndex:
    index = KvIndex(BLOCK)
    index.apply(instance_id, events)
    assert index.counters.invalid_events == index.counters.unknown_parent_blocks == 0
    return index


# --- admission, prefill, release ----------------------------------------------------------------


async def test_a_repeated_prompt_is_a_cache_hit_and_prefills_only_the_rest(
    engines: dict[str, MockContinuation], logs: Logs
) -> None:
    setup = Setup(engines["sglang"], prefill_ms_per_1k=50.0)
    request = preprocess("sglang", "Summarise the rules above.")
    prompt = request.token_ids
    full = len(prompt) // BLOCK
    assert full >= 4

    await setup.run(request)
    first_stored = setup.published.stored()[0]
    assert first_stored.parent_block_hash is None
    assert first_stored.token_ids == prompt[: full * BLOCK]
    assert first_stored.block_size == BLOCK
    await setup.run(request)

    first, second = setup.prefills
    assert first == Prefill(cached_tokens=0, seconds=pytest.approx(len(prompt) / 1000 * 0.05))
    # As in vLLM at least one token is computed: a prompt cached to its end reuses a block less.
    reused = ((len(prompt) - 1) // BLOCK) * BLOCK
    assert second.cached_tokens == reused > 0
    assert second.seconds == pytest.approx((len(prompt) - reused) / 1000 * 0.05)
    started = [entry for entry in logs if entry["event"] == "mock_generate_started"]
    assert [(e["cached_tokens"], e["prefill_ms"]) for e in started] == [
        (0, round(first.seconds * 1000, 3)),
        (reused, round(second.seconds * 1000, 3)),
    ]
    assert started[1]["prefill_ms"] < started[0]["prefill_ms"]


async def test_prefills_queue_one_after_another(engines: dict[str, MockContinuation]) -> None:
    """Two requests admitted at one instant: the second waits for the first's prefill, then its own;
    once the queue has drained, a request waits only for itself."""
    now = [100.0]
    setup = Setup(engines["sglang"], prefill_ms_per_1k=1000.0, clock=lambda: now[0])
    first_request = preprocess("sglang", "Summarise the rules above.")
    other_request = preprocess("sglang", "Something else entirely, please.")
    tasks = [asyncio.create_task(setup.run(r)) for r in (first_request, other_request)]
    try:
        await until(lambda: len(setup.prefills) == 2, "both admissions")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    first, second = setup.prefills
    own = (len(other_request.token_ids) - second.cached_tokens) / 1000
    assert first.seconds == pytest.approx(len(first_request.token_ids) / 1000)
    assert second.seconds == pytest.approx(first.seconds + own)
    now[0] += 3600
    task = asyncio.create_task(setup.run(other_request))
    try:
        await until(lambda: len(setup.prefills) == 3, "the late admission")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    late = setup.prefills[2]
    assert late.seconds == pytest.approx((len(other_request.token_ids) - late.cached_tokens) / 1000)


async def test_the_reply_completes_blocks_that_a_follow_up_turn_reuses(
    engines: dict[str, MockContinuation],
) -> None:
    setup = Setup(engines["sglang"])
    request = preprocess("sglang", "Say the rules back, please, all of them, in your own words.")
    reply = reply_ids(await setup.run(request))
    whole = [*request.token_ids, *reply]
    assert len(whole) // BLOCK > len(request.token_ids) // BLOCK  # the echo completes a block

    decode = setup.published.stored()[-1]
    start = len(request.token_ids) // BLOCK * BLOCK
    assert decode.token_ids == whole[start : len(whole) // BLOCK * BLOCK]
    assert decode.parent_block_hash == setup.published.stored()[0].block_hashes[-1]
    index = index_of(setup.published.events())
    assert index.match(request_block_hashes(whole, BLOCK)) == {"worker-a": len(whole) // BLOCK}


async def test_a_migrated_request_is_just_a_longer_prompt(engines: dict[str, MockContinuation]) -> None:
    setup = Setup(engines["sglang"])
    request = preprocess("sglang", "Summarise the rules above.")
    reply = reply_ids(await setup.run(request))
    migrated = msgspec.structs.replace(request, token_ids=[*request.token_ids, *reply[:3]])
    rest = reply_ids(await setup.run(migrated))
    assert rest == reply[3:]
    assert setup.prefills[1].cached_tokens == (len(migrated.token_ids) - 1) // BLOCK * BLOCK


async def test_a_cancelled_request_releases_its_blocks_for_eviction(
    engines: dict[str, MockContinuation],
) -> None:
    """The cache holds exactly the first prompt: the longer second one is cached only if the first,
    cancelled while it streams, let its blocks go."""
    first = preprocess("sglang", "The first question, about rule one.")
    second = preprocess("sglang", "A different question: " + TAIL)
    slow = Setup(
        MockContinuation(MockEngine(DEMO, flavor="sglang", token_delay_s=30.0)),
        capacity=len(first.token_ids) // BLOCK,
    )
    task = asyncio.create_task(slow.run(first))
    await until(lambda: slow.prefills, "the first request's admission")
    held = slow.published.stored()[0].block_hashes
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    fast = MockKvEngine(engines["sglang"], slow.cache, slow.published)
    [_ async for _ in fast.generate(second)]
    removed = [event for event in slow.published.events() if isinstance(event, BlockRemoved)]
    shared = common_prefix(first.token_ids, second.token_ids) // BLOCK
    assert 0 < shared < len(held)
    assert len(second.token_ids) // BLOCK - shared >= len(held) - shared  # needs all of the room
    assert sorted(h for event in removed for h in event.block_hashes) == sorted(held[shared:])
    assert len(slow.cache) == len(held)


async def test_a_prompt_that_breaks_the_contract_is_not_admitted(
    engines: dict[str, MockContinuation],
) -> None:
    setup = Setup(engines["vllm"])
    request = pictured("sglang", CAT)  # rendered for SGLang: vLLM finds no placeholder
    with pytest.raises(EngineContractError):
        await setup.run(request)
    assert setup.published.batches == [] and len(setup.cache) == 0


# --- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_prompts_that_differ_only_in_an_image_share_the_blocks_before_it(
    engines: dict[str, MockContinuation], flavor: str
) -> None:
    setup = Setup(engines[flavor])
    cat, dog = pictured(flavor, CAT), pictured(flavor, DOG)
    assert cat.token_ids == dog.token_ids
    pattern = engines[flavor].engine.image_pattern
    assert pattern is not None
    [start] = occurrences(cat.token_ids, pattern)
    image_block = start // BLOCK

    await setup.run(cat)
    await setup.run(dog)
    cat_hashes = setup.cache.block_hashes(cat.token_ids, image_spans(cat, pattern))
    dog_hashes = setup.cache.block_hashes(dog.token_ids, image_spans(dog, pattern))
    assert cat_hashes[:image_block] == dog_hashes[:image_block]
    assert not set(cat_hashes[image_block:]) & set(dog_hashes[image_block:])
    # The dog's admission stores only the blocks from its image on, chained to the shared ones.
    [dog_store] = [e for e in setup.published.stored() if e.block_hashes[0] == dog_hashes[image_block]]
    assert dog_store.block_hashes == dog_hashes[image_block : len(dog.token_ids) // BLOCK]
    assert dog_store.parent_block_hash == cat_hashes[image_block - 1]
    assert dog_store.extra_keys is not None
    for index, entry in enumerate(dog_store.extra_keys):
        block_start = (image_block + index) * BLOCK
        overlaps = block_start < start + len(pattern) and start < block_start + BLOCK
        assert entry == ([(image_uuid(DOG), start - block_start)] if overlaps else None)
    assert dog_store.extra_keys[0] is not None


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_the_frontend_index_finds_image_blocks_by_the_image_identity(
    engines: dict[str, MockContinuation], flavor: str
) -> None:
    """Spans built by hand as the frontend will (placeholder ids, the image's uuid), not by the mock."""
    setup = Setup(engines[flavor])
    cat, dog = pictured(flavor, CAT), pictured(flavor, DOG)
    await setup.run(cat)
    index = index_of(setup.published.events())

    placeholder = engines[flavor].engine.tokenizer.encode(
        "<|media_pad|>" if flavor == "sglang" else "<|kimi_image_placeholder|>", allow_special=True
    )
    [start] = occurrences(cat.token_ids, placeholder)
    full = len(cat.token_ids) // BLOCK

    def own(request: PreprocessedRequest, url: str) -> list[int]:
        spans = [ImageSpan(identifier=image_uuid(url), start=start, length=len(placeholder))]
        return request_block_hashes(request.token_ids, BLOCK, spans)

    assert index.match(own(cat, CAT)) == {"worker-a": full}
    assert index.match(own(dog, DOG)) == {"worker-a": start // BLOCK}
    assert index.match(request_block_hashes(cat.token_ids, BLOCK)) == {"worker-a": start // BLOCK}
    engine_hashes = {h for event in setup.published.stored() for h in event.block_hashes}
    assert not engine_hashes & set(own(cat, CAT))


def test_an_image_without_a_uuid_gets_the_frontends_identity(engines: dict[str, MockContinuation]) -> None:
    request = pictured("sglang", CAT)
    older = msgspec.structs.replace(
        request, images=[msgspec.structs.replace(image, uuid="") for image in request.images]
    )
    pattern = engines["sglang"].engine.image_pattern
    assert image_spans(older, pattern) == image_spans(request, pattern)
    assert image_spans(request, pattern)[0].identifier == request.images[0].uuid == image_uuid(CAT)
    assert image_spans(request, None) == []


def test_a_negative_prefill_rate_is_refused(engines: dict[str, MockContinuation]) -> None:
    with pytest.raises(ValueError, match="prefill_ms_per_1k"):
        MockKvEngine(engines["sglang"], PagedPrefixCache(BLOCK, 4), print, prefill_ms_per_1k=-1)


# --- a real engine's --kv-events-config -----------------------------------------------------------

HOST = "10.1.2.3"
VLLM_CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558",
    "topic": "kv-events",
    "buffer_steps": 10000,
}


# SGLang 0.5.23: no enable_kv_cache_events (publisher zmq is the switch).
SGLANG_CONFIG = {
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558",
    "topic": "kv",
    "buffer_steps": 10000,
    "hwm": 100000,
    "max_queue_size": 100000,
}


def advertised(config: Any, flavor: str = "vllm", **options: Any) -> KvEventsEndpoint | None:
    options.setdefault("endpoint_host", HOST)
    return kv_events_endpoint(config, flavor=flavor, **options)


def test_vllm_config_is_advertised_on_the_worker_host() -> None:
    assert advertised(VLLM_CONFIG) == KvEventsEndpoint(
        endpoint="tcp://10.1.2.3:5557", replay_endpoint="tcp://10.1.2.3:5558", topic="kv-events"
    )


def test_the_data_parallel_rank_offsets_both_ports_as_vllm_does() -> None:
    found = advertised(VLLM_CONFIG, data_parallel_rank=3)
    assert found is not None
    assert (found.endpoint, found.replay_endpoint) == ("tcp://10.1.2.3:5560", "tcp://10.1.2.3:5561")


@pytest.mark.parametrize(
    ("config", "flavor", "expected"),
    [
        # vLLM: publisher defaults to zmq when enabled; no replay endpoint unless configured.
        ({"enable_kv_cache_events": True}, "vllm", ("tcp://10.1.2.3:5557", None, "")),
        # SGLang has no enable_kv_cache_events: publisher zmq is enough; JSON text as given.
        ('{"publisher": "zmq", "endpoint": "tcp://*:6000"}', "sglang", ("tcp://10.1.2.3:6000", None, "")),
        # The replay ROUTER always binds: 0.0.0.0 is a wildcard there, a concrete host stays.
        (
            {**VLLM_CONFIG, "replay_endpoint": "tcp://0.0.0.0:5558"},
            "vllm",
            ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "kv-events"),
        ),
        (
            {**VLLM_CONFIG, "replay_endpoint": "tcp://10.9.9.9:5558"},
            "vllm",
            ("tcp://10.1.2.3:5557", "tcp://10.9.9.9:5558", "kv-events"),
        ),
        (
            {**VLLM_CONFIG, "endpoint": "ipc:///run/kv.sock"},
            "sglang",
            ("ipc:///run/kv.sock", "tcp://10.1.2.3:5558", "kv-events"),
        ),
        # A replay endpoint no other process can reach: followed without replay.
        (
            {**VLLM_CONFIG, "replay_endpoint": "inproc://replay"},
            "vllm",
            ("tcp://10.1.2.3:5557", None, "kv-events"),
        ),
    ],
)
def test_what_each_config_advertises(config: Any, flavor: str, expected: tuple[str | None, ...]) -> None:
    found = advertised(config, flavor)
    assert found is not None
    assert (found.endpoint, found.replay_endpoint, found.topic) == expected


def test_an_ipv6_wildcard_becomes_the_bracketed_host() -> None:
    found = advertised({**VLLM_CONFIG, "endpoint": "tcp://[::]:5557"}, endpoint_host="fd00::7")
    assert found is not None and found.endpoint == "tcp://[fd00::7]:5557"


def test_the_engines_config_object_is_read_by_attribute() -> None:
    config = types.SimpleNamespace(**VLLM_CONFIG)
    assert advertised(config) == advertised(VLLM_CONFIG)


@pytest.mark.parametrize(
    ("config", "flavor", "reason", "level"),
    [
        ({**VLLM_CONFIG, "enable_kv_cache_events": False}, "vllm", "disabled", "info"),
        ({"publisher": "zmq"}, "vllm", "disabled", "info"),  # vLLM needs enable_kv_cache_events
        ({"enable_kv_cache_events": True}, "sglang", "disabled", "info"),  # SGLang's publisher: "null"
        ({**VLLM_CONFIG, "publisher": "null"}, "vllm", "disabled", "info"),
        ({**VLLM_CONFIG, "publisher": "kafka"}, "vllm", "publisher_not_zmq", "warning"),
        ({**VLLM_CONFIG, "endpoint": "tcp://10.0.0.5:5557"}, "vllm", "publisher_connects", "warning"),
        ({**VLLM_CONFIG, "endpoint": "tcp://0.0.0.0:5557"}, "vllm", "publisher_connects", "warning"),
        ({**SGLANG_CONFIG, "endpoint": "tcp://10.0.0.5:5557"}, "sglang", "publisher_connects", "warning"),
        (
            {**SGLANG_CONFIG, "endpoint": "tcp://10.0.0.5:5557", "bind": False},
            "sglang",
            "publisher_connects",
            "warning",
        ),
        ({**SGLANG_CONFIG, "bind": False}, "sglang", "publisher_connects", "warning"),
        (
            {**SGLANG_CONFIG, "endpoint": "ipc:///run/kv.sock", "bind": False},
            "sglang",
            "publisher_connects",
            "warning",
        ),
        ({**SGLANG_CONFIG, "endpoint": "inproc://kv", "bind": True}, "sglang", "inproc", "warning"),
        ({**VLLM_CONFIG, "endpoint": "inproc://kv"}, "vllm", "inproc", "warning"),
        ({**VLLM_CONFIG, "endpoint": "tcp://*:*"}, "vllm", "no_port", "warning"),
    ],
)
def test_a_config_that_cannot_be_followed_advertises_nothing_and_says_why(
    config: dict[str, Any], flavor: str, reason: str, level: str, logs: Logs
) -> None:
    assert advertised(config, flavor) is None
    [line] = [entry for entry in logs if entry["event"] == "kv_events_not_advertised"]
    assert (line["reason"], line["log_level"], line["flavor"]) == (reason, level, flavor)


@pytest.mark.parametrize(
    ("config", "rank", "message"),
    [
        ("not json", 0, "kv_events_config"),
        ("[1, 2]", 0, "kv_events_config"),
        ({"enable_kv_cache_events": "yes"}, 0, "kv_events_config"),
        ({**VLLM_CONFIG, "endpoint": "tcp://*:port"}, 1, "is not a number"),
        (VLLM_CONFIG, -1, "data_parallel_rank"),
    ],
)
def test_a_config_the_engine_would_refuse_is_an_error(config: Any, rank: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        advertised(config, data_parallel_rank=rank)


# -- SGLang 0.5.23: no enable key, an explicit bind, a hash format ------------------------------


def endpoints(found: KvEventsEndpoint | None) -> tuple[str | None, ...] | None:
    return None if found is None else (found.endpoint, found.replay_endpoint, found.topic)


def test_sglang_publishes_without_the_enable_key() -> None:
    found = advertised(SGLANG_CONFIG, "sglang")
    assert endpoints(found) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "kv")


def test_sglang_ignores_the_enable_key_it_does_not_have() -> None:
    """SGLang drops unknown keys, ``enable_kv_cache_events: false`` included: it still publishes."""
    found = advertised({**SGLANG_CONFIG, "enable_kv_cache_events": False}, "sglang")
    assert found == advertised(SGLANG_CONFIG, "sglang")


def test_vllm_still_needs_the_enable_key(logs: Logs) -> None:
    assert advertised(SGLANG_CONFIG, "vllm") is None
    [line] = [entry for entry in logs if entry["event"] == "kv_events_not_advertised"]
    assert (line["reason"], line["publisher"]) == ("disabled", "zmq")


@pytest.mark.parametrize("host", ["10.9.9.9", "127.0.0.1", "[fd00::9]", "worker-0.example"])
def test_sglang_bind_true_advertises_its_concrete_host(host: str) -> None:
    config = {**SGLANG_CONFIG, "endpoint": f"tcp://{host}:5557", "bind": True}
    assert endpoints(advertised(config, "sglang")) == (f"tcp://{host}:5557", "tcp://10.1.2.3:5558", "kv")


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0"])
@pytest.mark.parametrize("bind", [True, None])
def test_a_wildcard_sglang_binds_is_advertised_on_the_worker_host(wildcard: str, bind: bool | None) -> None:
    """SGLang binds ``0.0.0.0`` as it binds ``*`` (vLLM connects to it)."""
    config = {**SGLANG_CONFIG, "endpoint": f"tcp://{wildcard}:5557", "bind": bind}
    found = advertised(config, "sglang", endpoint_host="192.168.7.7")
    assert endpoints(found) == ("tcp://192.168.7.7:5557", "tcp://192.168.7.7:5558", "kv")


def test_a_concrete_host_sglang_connects_to_is_logged_not_advertised(logs: Logs) -> None:
    assert advertised({**SGLANG_CONFIG, "endpoint": "tcp://10.9.9.9:5557"}, "sglang") is None
    [line] = [entry for entry in logs if entry["event"] == "kv_events_not_advertised"]
    expected = {"log_level": "warning", "reason": "publisher_connects", "flavor": "sglang"}
    assert {key: line[key] for key in expected} == expected
    assert (line["endpoint"], line["data_parallel_rank"]) == ("tcp://10.9.9.9:5557", 0)


@pytest.mark.parametrize(
    ("config", "rank", "expected"),
    [
        (SGLANG_CONFIG, 2, ("tcp://10.1.2.3:5559", "tcp://10.1.2.3:5560", "kv")),
        (
            {**SGLANG_CONFIG, "endpoint": "tcp://10.9.9.9:7000", "bind": True},
            3,
            ("tcp://10.9.9.9:7003", "tcp://10.1.2.3:5561", "kv"),
        ),
    ],
)
def test_sglang_data_parallel_ranks_offset_both_ports(
    config: dict[str, Any], rank: int, expected: tuple[str, ...]
) -> None:
    assert endpoints(advertised(config, "sglang", data_parallel_rank=rank)) == expected


@pytest.mark.parametrize("hash_format", ["default", "dynamo"])
def test_sglang_hash_formats_publish_the_same_wire(hash_format: str) -> None:
    """``"dynamo"`` only namespaces the (opaque) block hashes: followed like the default."""
    found = advertised({**SGLANG_CONFIG, "format": hash_format}, "sglang")
    assert found == advertised(SGLANG_CONFIG, "sglang")


@pytest.mark.parametrize("hash_format", ["vllm", "Dynamo", ""])
def test_an_sglang_format_sglang_refuses_is_an_error_naming_the_field(hash_format: str) -> None:
    with pytest.raises(ValueError, match=r"format must be one of 'default', 'dynamo', got"):
        advertised({**SGLANG_CONFIG, "format": hash_format}, "sglang")


def test_an_sglang_format_is_checked_even_when_nothing_publishes() -> None:
    """SGLang reads ``format`` whenever the config is set, so it refuses to start either way."""
    with pytest.raises(ValueError, match="format"):
        advertised({"publisher": "null", "format": "raw"}, "sglang")


def test_unknown_keys_are_ignored() -> None:
    extra = {"future_key": {"nested": [1, 2]}, "max_queue_size": 5, "hwm": 7}
    assert advertised({**SGLANG_CONFIG, **extra}, "sglang") == advertised(SGLANG_CONFIG, "sglang")
    assert advertised({**VLLM_CONFIG, **extra}) == advertised(VLLM_CONFIG)


def test_vllm_ignores_sglangs_bind_and_format() -> None:
    """vLLM has neither key (it refuses them itself): its own address rule decides."""
    assert advertised({**VLLM_CONFIG, "endpoint": "tcp://10.9.9.9:5557", "bind": True}) is None
    assert advertised({**VLLM_CONFIG, "format": "raw"}) == advertised(VLLM_CONFIG)


def test_sglangs_config_object_is_read_by_attribute() -> None:
    """SGLang's own ``KVEventsConfig`` (a pydantic model) has no ``enable_kv_cache_events``."""
    config = types.SimpleNamespace(**{**SGLANG_CONFIG, "bind": None, "format": "dynamo"})
    assert advertised(config, "sglang") == advertised(SGLANG_CONFIG, "sglang")


async def test_register_announces_the_engines_kv_events_address() -> None:
    """``register`` with vLLM's config (``None`` stands in for the engine: vLLM needs a GPU)."""
    address = tcp_endpoint()
    with SubCollector(address, bind=True) as collector:
        worker = await register(
            None,
            flavor="vllm",
            model_path=DEMO,
            discovery=[address],
            kv_events_config=VLLM_CONFIG,
            data_parallel_rank=1,
            kv_cache_block_size=32,
        )
        try:
            announced = await asyncio.to_thread(collector.wait_messages, lambda m: isinstance(m, Announce))
            announce = announced[0]
        finally:
            await worker.stop()
    assert isinstance(announce, Announce)
    assert announce.kv_events == KvEventsEndpoint(
        endpoint="tcp://127.0.0.1:5558", replay_endpoint="tcp://127.0.0.1:5559", topic="kv-events"
    )
    assert decode_card(announce.card).card.kv_cache_block_size == 32
