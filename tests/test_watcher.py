"""The discovery watcher in-process, on real ZeroMQ sockets over loopback.

A test XPUB socket plays the worker: it connects to the watcher's bound SUB, waits for the
subscription (so nothing is lost to the slow joiner), then sends crafted envelopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from support.logs import TIMEOUT_S, Logs, find, until
from support.plane import start_dynamo

from dynamo_prep.card import ModelDeploymentCard, encode_card
from dynamo_prep.discovery import watcher as watcher_module
from dynamo_prep.discovery.builder import BuiltModel, ModelBuildError, PreprocessorBuilder
from dynamo_prep.discovery.eventlog import DiscoveryLog
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.discovery.registry import DiscoveryRegistry
from dynamo_prep.discovery.trust import ClientCurve, ServerCurve, apply_client_curve, generate_keys
from dynamo_prep.discovery.watcher import DiscoveryWatcher
from dynamo_prep.frontend.client import RequestPlaneClient
from dynamo_prep.logging import RateLimiter
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.protocol.discovery import (
    Announce,
    Instance,
    Withdraw,
    encode_message,
    reachable_from_elsewhere,
    topic,
)

K3 = "kimi-k3-demo"
MEDIA_PAD = "<|media_pad|>"
KIMI_DEFAULT = "<|kimi_image_placeholder|>"
LOOPBACK = "tcp://127.0.0.1:0"


# -- helpers -------------------------------------------------------------------------------------


async def wait_log(
    logs: Logs, event: str, timeout: float = TIMEOUT_S, **fields: Any
) -> MutableMapping[str, Any]:
    hits: Logs = await until(lambda: find(logs, event, **fields), f"{event} {fields}", timeout)
    return hits[0]


def card_bytes(card: ModelDeploymentCard, **runtime: Any) -> bytes:
    if not runtime:
        return encode_card(card)
    fields = msgspec.msgpack.decode(encode_card(card))
    fields["runtime_config"] = {**fields.get("runtime_config", {}), **runtime}
    return msgspec.msgpack.encode(fields)


def announce(instance_id: str, seq: int, raw: bytes, *, ttl_ms: int = 3000) -> bytes:
    message = Announce(
        instance_id=instance_id,
        seq=seq,
        sent_ms=0,
        ttl_ms=ttl_ms,
        endpoint="tcp://127.0.0.1:9",
        card=msgspec.Raw(raw),
    )
    return encode_message(message)


class Peer:
    """A worker stand-in: an XPUB that connects to the watcher and sends raw frames."""

    def __init__(self, context: zmq.asyncio.Context, address: str, curve: ClientCurve | None = None) -> None:
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        if curve is not None:
            apply_client_curve(self.socket, curve)
        self.socket.connect(address)

    async def subscribed(self, timeout: float = TIMEOUT_S) -> None:
        frame = await asyncio.wait_for(self.socket.recv(), timeout)
        assert frame[:1] == b"\x01", frame

    async def send(self, *frames: bytes) -> None:
        await self.socket.send_multipart(list(frames))

    async def publish(self, payload: bytes, namespace: str = "dynamo") -> None:
        await self.send(topic(namespace), payload)

    def close(self) -> None:
        self.socket.close(linger=0)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_card() -> ModelDeploymentCard:
    return ModelDeploymentCard.from_model_dir(K3)


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def builder(tmp_path: Path) -> PreprocessorBuilder:
    """The production builder; the demo model is local, so no fetch is needed."""
    return PreprocessorBuilder(
        ModelFileStore(tmp_path / "cache"), local_model_path=resolve_model_dir(K3), fetch_timeout_s=1.0
    )


Start = Callable[..., Any]


@pytest.fixture
async def start(
    logs: Logs, context: zmq.asyncio.Context, builder: PreprocessorBuilder
) -> AsyncIterator[Start]:
    """``await start(**kwargs)`` -> (watcher, peer): a running watcher and a subscribed peer."""
    tasks: list[asyncio.Task[None]] = []
    peers: list[Peer] = []

    async def _start(
        *, curve: ServerCurve | None = None, peer_curve: ClientCurve | None = None, **kwargs: Any
    ) -> tuple[DiscoveryWatcher, Peer]:
        kwargs.setdefault("builder", builder)
        watcher = DiscoveryWatcher(bind=[LOOPBACK], context=context, curve=curve, **kwargs)
        watcher.open()
        tasks.append(asyncio.create_task(watcher.run()))
        peer = Peer(context, watcher.addresses[0], peer_curve)
        peers.append(peer)
        await peer.subscribed()
        return watcher, peer

    yield _start
    for peer in peers:
        peer.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- tests ---------------------------------------------------------------------------------------


async def test_first_announce_builds_a_working_preprocessor(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start()
    await peer.publish(announce("i-1", 1, card_bytes(k3_card)))
    added = await wait_log(logs, "model_added")
    assert added["model"] == "kimi-k3-demo"
    assert added["mdcsum"] == k3_card.mdcsum()
    assert added["instance_id"] == "i-1"
    assert added["declared_token"] is None
    assert added["rendered_token"] == KIMI_DEFAULT
    assert added["formatter"] == "kimi_k3"
    assert added["log_level"] == "info"
    instance = find(logs, "instance_added", instance_id="i-1")[0]
    assert instance["endpoint"] == "tcp://127.0.0.1:9"
    assert instance["namespace"] == "dynamo"

    assert watcher.catalog.names() == ["kimi-k3-demo"]
    live = watcher.catalog.get("kimi-k3-demo")
    assert live is not None
    assert dict(live.instances) == {"i-1": Instance(instance_id="i-1", endpoint="tcp://127.0.0.1:9")}
    assert live.preprocessor.formatter.kind == "kimi_k3"
    expected = OpenAIPreprocessor.new(k3_card, K3)
    request = {"model": "kimi-k3-demo", "messages": [{"role": "user", "content": "hello there"}]}
    assert live.preprocessor.tokenize(request).token_ids == expected.tokenize(request).token_ids


async def test_declared_token_reaches_the_formatter(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start()
    await peer.publish(announce("sg-1", 1, card_bytes(k3_card, image_placeholder_token=MEDIA_PAD)))
    added = await wait_log(logs, "model_added")
    assert added["declared_token"] == MEDIA_PAD
    assert added["rendered_token"] == MEDIA_PAD
    live = watcher.catalog.get("kimi-k3-demo")
    assert live is not None
    request = {
        "model": "kimi-k3-demo",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "http://x/cat.png"}},
                    {"type": "text", "text": "what is it?"},
                ],
            }
        ],
    }
    prompt = live.preprocessor.tokenize(request)
    media_pad = live.preprocessor.tokenizer.token_to_id(MEDIA_PAD)
    assert prompt.token_ids.count(media_pad) == 1


async def test_garbage_is_counted_and_the_watcher_keeps_serving(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    clock = FakeClock()  # frozen: every rate-limited line falls in the same second
    watcher, peer = await start(clock=clock)
    name = topic()
    rng = random.Random(1234)
    huge = msgspec.msgpack.encode(
        {"v": 1, "kind": "announce", "pad": "x" * (1 << 20), "more": list(range(99))}
    )
    wrong_types = msgspec.msgpack.encode(
        {"v": 1, "kind": "announce", "instance_id": 5, "seq": "one", "sent_ms": 0, "endpoint": [], "card": 3}
    )
    bad_card = announce("bad-card", 1, msgspec.msgpack.encode({"display_name": ["not", "a", "string"]}))
    garbage: list[tuple[bytes, ...]] = [
        (name, bytes(rng.getrandbits(8) for _ in range(64))),  # random bytes
        (name, b"\xc1"),  # never valid MessagePack
        (name,),  # single frame
        (name, b"\x80", b"extra"),  # three frames
        (name, wrong_types),
        (name, msgspec.msgpack.encode([1, 2, 3])),  # not a map
        (name, huge),
        (name, msgspec.msgpack.encode({"v": 1, "kind": "explode"})),
        (name, msgspec.msgpack.encode({"v": 2, "kind": "announce"})),
        (name, bad_card),
        (topic("dynamo-other"), announce("elsewhere", 1, card_bytes(k3_card))),
    ]
    garbage += [(name, b"\xc1")] * 20  # a flood of one reason: logged once
    for frames in garbage:
        await peer.send(*frames)
    await peer.publish(announce("good", 1, card_bytes(k3_card)))
    await wait_log(logs, "instance_added", instance_id="good")

    assert watcher.counters["messages"] == len(garbage) + 1
    for reason in (
        "frame_count",
        "invalid",
        "too_large",
        "unknown_kind",
        "unsupported_version",
        "invalid_card",
    ):
        assert watcher.counters[reason] >= 1, reason
    assert watcher.counters["frame_count"] == 2
    assert watcher.counters["too_large"] == 1
    assert watcher.counters["undecodable"] >= 21
    assert watcher.counters["other_topic"] == 1
    rejected = find(logs, "card_rejected")
    reasons = [line["reason"] for line in rejected]
    assert len(reasons) == len(set(reasons)), "at most one line per reason per second"
    assert set(reasons) >= {"frame_count", "undecodable", "invalid", "too_large", "unknown_kind"}
    assert all(line["log_level"] == "warning" and len(line["detail"]) <= 300 for line in rejected)
    await wait_log(logs, "model_added", model="kimi-k3-demo")


async def test_card_rejected_lines_resume_after_a_second_with_a_suppressed_count() -> None:
    limiter = RateLimiter(interval_s=1.0)
    assert limiter.allow("card_rejected:invalid", 10.0) == 0
    assert limiter.allow("card_rejected:invalid", 10.5) is None
    assert limiter.allow("card_rejected:invalid", 10.9) is None
    assert limiter.allow("card_rejected:undecodable", 10.9) == 0
    assert limiter.allow("card_rejected:invalid", 11.0) == 2


async def test_legacy_card_is_logged_once_with_what_renders_instead(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start()
    legacy = card_bytes(k3_card, expands_image_pad_token=True)
    await peer.publish(announce("old", 1, legacy))
    await wait_log(logs, "model_added")
    for seq in (2, 3, 4):
        await peer.publish(announce("old", seq, legacy))
    await peer.publish(announce("new", 1, card_bytes(k3_card)))  # a marker behind the heartbeats
    await wait_log(logs, "instance_added", instance_id="new")
    lines = find(logs, "legacy_card_silent_downgrade")
    assert len(lines) == 1
    line = lines[0]
    assert line["log_level"] == "warning"
    assert line["model"] == "kimi-k3-demo"
    assert line["instance_id"] == "old"
    assert line["legacy_key"] == "expands_image_pad_token"
    assert line["legacy_value"] is True
    assert line["rendered_instead"] == KIMI_DEFAULT
    assert watcher.catalog.names() == ["kimi-k3-demo"]


async def test_checksum_mismatch_names_the_differing_fields(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start()
    await peer.publish(announce("v1", 1, card_bytes(k3_card)))
    other = msgspec.structs.replace(k3_card, context_length=4096)
    await peer.publish(announce("v2", 1, card_bytes(other)))
    line = await wait_log(logs, "card_checksum_mismatch")
    assert line["log_level"] == "error"
    assert line["model"] == "kimi-k3-demo"
    assert line["instance_id"] == "v2"
    assert line["canonical_mdcsum"] == k3_card.mdcsum()
    assert line["mdcsum"] == other.mdcsum()
    assert line["differing_fields"] == {"context_length": {"canonical": 8192, "offered": 4096}}
    assert "drain" in line["hint"].lower()
    await wait_log(logs, "model_added")
    live = watcher.catalog.get("kimi-k3-demo")
    assert live is not None and set(live.instances) == {"v1"}


async def test_runtime_config_conflict_logs_both_values(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start()
    await peer.publish(announce("vllm", 1, card_bytes(k3_card)))
    await peer.publish(announce("sglang", 1, card_bytes(k3_card, image_placeholder_token=MEDIA_PAD)))
    line = await wait_log(logs, "runtime_config_conflict")
    assert line["log_level"] == "warning"
    assert line["instance_id"] == "sglang"
    assert line["first_instance_id"] == "vllm"
    assert line["field"] == "image_placeholder_token"
    assert line["first_value"] is None
    assert line["later_value"] == MEDIA_PAD
    added = await wait_log(logs, "model_added")
    assert added["rendered_token"] == KIMI_DEFAULT  # the canonical preprocessor: the first card's
    await until(lambda: len(live_instances(watcher)) == 2, "2 live instances")


def live_instances(watcher: DiscoveryWatcher, model: str = "kimi-k3-demo") -> set[str]:
    live = watcher.catalog.get(model)
    return set(live.instances) if live is not None else set()


async def test_expiry_removes_the_instance_and_the_model(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start()
    await peer.publish(announce("short", 1, card_bytes(k3_card), ttl_ms=300))
    sent = time.monotonic()
    await wait_log(logs, "instance_added", instance_id="short")
    removed = await wait_log(logs, "instance_removed", instance_id="short")
    elapsed = time.monotonic() - sent
    assert removed["reason"] == "expired"
    assert elapsed >= 0.25  # not before its TTL (how long after it depends on the machine's load)
    await wait_log(logs, "model_removed", model="kimi-k3-demo")
    assert watcher.catalog.names() == []
    assert watcher.registry.model_names() == []


async def test_withdraw_removes_at_once(start: Start, logs: Logs, k3_card: ModelDeploymentCard) -> None:
    released: list[str] = []
    watcher, peer = await start(on_model_removed=released.append)
    await peer.publish(announce("w", 1, card_bytes(k3_card), ttl_ms=60_000))
    await wait_log(logs, "model_added")
    assert watcher.catalog.names() == ["kimi-k3-demo"] and released == []
    await peer.publish(encode_message(Withdraw(instance_id="w", seq=2, sent_ms=0)))
    removed = await wait_log(logs, "instance_removed", instance_id="w")
    assert removed["reason"] == "withdraw"
    await wait_log(logs, "model_removed")
    assert watcher.catalog.names() == []
    assert watcher.catalog.get("kimi-k3-demo") is None
    assert released == [k3_card.mdcsum()]  # its cached files may be evicted from now on


async def test_a_flood_larger_than_one_drain_is_fully_processed(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    watcher, peer = await start(max_drain=4)
    raw = card_bytes(k3_card)
    for seq in range(1, 41):
        await peer.publish(announce("flood", seq, raw))
    await until(lambda: watcher.counters["messages"] == 40, "40 messages")
    assert watcher.registry.counters["cards_decoded"] == 1
    assert len(find(logs, "instance_added")) == 1


async def test_a_drain_stops_at_its_time_budget_and_the_flood_is_still_processed(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no time for a drain, each one stops after one message (the loop serves others between
    them, issue 13's flood of names); nothing is lost."""
    monkeypatch.setattr(watcher_module, "MAX_DRAIN_S", 0.0)
    watcher, peer = await start()
    stopped_early: list[bool] = []
    drain = watcher._drain

    def counted() -> bool:
        stopped_early.append(drain())
        return stopped_early[-1]

    watcher._drain = counted  # type: ignore[method-assign]
    raw = card_bytes(k3_card)
    for seq in range(1, 41):
        await peer.publish(announce("flood", seq, raw))
    await until(lambda: watcher.counters["messages"] == 40, "40 messages")
    assert stopped_early.count(True) == 40  # one message per drain, far below max_drain
    assert len(find(logs, "instance_added")) == 1


@pytest.mark.parametrize(("model", "kept"), [(K3, 1), ("qwen-vl-demo", 3)])
async def test_a_served_model_keeps_one_to_three_objects_the_gc_walks(
    start: Start, logs: Logs, tmp_path: Path, model: str, kept: int
) -> None:
    """Issue 13's flood of 10,000 names: every object a model keeps that the garbage collector
    tracks lengthens each full collection, a pause of the event loop (20 per K3 model made it
    300 ms; 263 per Jinja model). The registry's, the watcher's and the catalog's records are
    untracked, models of the same files share one tokenizer and one set of special-token patterns,
    and K3 models of one declaration one formatter: the preprocessor remains (and a Jinja
    formatter, with its attributes)."""
    card = ModelDeploymentCard.from_model_dir(model)
    builder = PreprocessorBuilder(
        ModelFileStore(tmp_path / "store"), local_model_path=resolve_model_dir(model)
    )
    watcher, peer = await start(builder=builder)

    async def serve(names: list[str]) -> None:
        cards = {
            name: card_bytes(msgspec.structs.replace(card, display_name=name, slug=name)) for name in names
        }
        deadline = time.monotonic() + 3 * TIMEOUT_S
        seq = 0
        while not all(watcher.catalog.get(name) for name in names):
            assert time.monotonic() < deadline, f"{len(names)} models not served"
            seq += 1  # a heartbeat: a model beyond the builds in flight is built on its next one
            for name, raw in cards.items():
                await peer.publish(announce(f"i-{name}", seq, raw, ttl_ms=600_000))
            with contextlib.suppress(AssertionError):
                await until(lambda: all(watcher.catalog.get(name) for name in names), "served", 0.5)
        # Every announce published is read (none still queued as frames the GC would count).
        await until(lambda: all(watcher.registry.serving(f"i-{name}", seq) for name in names), "read")
        logs.clear()  # the captured log lines are the test's, not the frontend's
        gc.collect()

    await serve([f"warm-{index}" for index in range(10)])
    before = len(gc.get_objects())
    names = [f"model-{index}" for index in range(200)]
    await serve(names)
    per_model = (len(gc.get_objects()) - before) / len(names)
    # One object more a model would be kept + 1; the rest is the loop's own (more of it on a busy machine).
    assert per_model <= kept + 0.5, per_model
    served = [watcher.catalog.get(name) for name in names]
    assert len({id(model.preprocessor.tokenizer) for model in served if model is not None}) == 1


async def test_a_scale_up_of_a_model_in_use_gets_into_a_table_full_of_served_junk(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    """Issue 13: names announced with a served model's files build, so their instances are kept;
    once a worker of the real model answered a request (``model_answered``, reported by the request
    plane), a second worker of it gets in, in place of the junk built last."""
    watcher, peer = await start(registry=DiscoveryRegistry(max_instances=3))  # a table of three
    await peer.publish(announce("real", 1, card_bytes(k3_card)))
    for name in ("junk-0", "junk-1"):
        await peer.publish(announce(name, 1, card_bytes(msgspec.structs.replace(k3_card, display_name=name))))
    await until(lambda: all(watcher.catalog.get(name) for name in (K3, "junk-0", "junk-1")), "all served")
    await peer.publish(announce("real-2", 1, card_bytes(k3_card)))
    await wait_log(logs, "card_rejected", reason="too_many_instances")
    watcher.model_answered(K3)
    await peer.publish(announce("real-2", 2, card_bytes(k3_card)))
    evicted = await wait_log(logs, "instance_removed", reason="evicted")  # the junk built last
    await until(lambda: live_instances(watcher) == {"real", "real-2"}, "the scale-up served")
    assert evicted["instance_id"] in {"junk-0", "junk-1"}
    assert sum(watcher.catalog.get(name) is not None for name in ("junk-0", "junk-1")) == 1


async def test_a_worker_of_a_new_model_is_probed_into_a_table_full_of_served_junk(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard
) -> None:
    """Issue 13: with the table full of built junk, a real worker of a model nobody used yet is
    refused, probed on the request plane (it answers; junk at dead ports does not) and let in on
    its next heartbeat, in place of the junk built last."""
    client = RequestPlaneClient()
    watcher, peer = await start(prober=client.answers, registry=DiscoveryRegistry(max_instances=2))  # of two
    for name in ("junk-0", "junk-1"):
        raw = card_bytes(msgspec.structs.replace(k3_card, display_name=name, slug=name))
        await peer.publish(announce(name, 1, raw))
    await until(lambda: watcher.catalog.get("junk-0") and watcher.catalog.get("junk-1"), "junk served")
    worker = start_dynamo(
        "worker", "--model-path", K3, "--served-name", "brand-new", "--discovery", watcher.addresses[0],
        "--heartbeat", "0.2", "--token-delay", "0",
    )  # fmt: skip
    try:
        instance_id = (await asyncio.to_thread(worker.wait_event, "worker_started"))["instance_id"]
        await wait_log(logs, "instance_proven", instance_id=instance_id)
        await until(lambda: watcher.catalog.get("brand-new"), "the new model served")
        assert sum(watcher.catalog.get(name) is not None for name in ("junk-0", "junk-1")) == 1
        assert find(logs, "instance_removed", reason="evicted")
    finally:
        worker.stop()
        await client.close()


class FlakyBuilder:
    """Fails the first build, then builds for real; optionally blocks until released."""

    def __init__(self, real: PreprocessorBuilder, *, failures: int = 1) -> None:
        self.real = real
        self.failures = failures
        self.calls = 0
        self.release = threading.Event()
        self.release.set()

    def __call__(self, card: ModelDeploymentCard, endpoint: str) -> BuiltModel:
        self.calls += 1
        self.release.wait(TIMEOUT_S)
        if self.calls <= self.failures:
            raise ModelBuildError("files", OSError("worker unreachable"))
        return self.real(card, endpoint)


async def test_failed_build_is_logged_and_retried_on_a_later_announce(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard, builder: PreprocessorBuilder
) -> None:
    clock = FakeClock()
    flaky = FlakyBuilder(builder)
    watcher, peer = await start(builder=flaky, clock=clock)
    raw = card_bytes(k3_card, expands_image_pad_token=True)
    await peer.publish(announce("a", 1, raw, ttl_ms=600_000))
    failed = await wait_log(logs, "model_build_failed")
    assert failed["log_level"] == "error"
    assert failed["reason"] == "files"
    assert "worker unreachable" in failed["error"]
    assert failed["attempt"] == 1 and failed["retry_in_s"] == 1.0
    legacy = await wait_log(logs, "legacy_card_silent_downgrade")
    assert legacy["rendered_instead"] == "checkpoint default"  # the model dir is unknown
    assert watcher.catalog.names() == []
    await peer.publish(announce("a", 2, raw, ttl_ms=600_000))  # inside the backoff: no retry
    await until(lambda: watcher.counters["messages"] == 2, "2 messages")
    assert flaky.calls == 1
    clock.now += 1.5
    await peer.publish(announce("a", 3, raw, ttl_ms=600_000))
    await wait_log(logs, "model_added")
    assert flaky.calls == 2
    assert watcher.catalog.names() == ["kimi-k3-demo"]
    assert len(find(logs, "legacy_card_silent_downgrade")) == 1


async def test_build_result_is_dropped_when_the_model_left_meanwhile(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard, builder: PreprocessorBuilder
) -> None:
    slow = FlakyBuilder(builder, failures=0)
    slow.release.clear()
    watcher, peer = await start(builder=slow)
    await peer.publish(announce("gone", 1, card_bytes(k3_card)))
    await until(lambda: slow.calls == 1, "the build to start")
    await peer.publish(encode_message(Withdraw(instance_id="gone", seq=2, sent_ms=0)))
    await wait_log(logs, "model_removed")  # served while the build blocks its thread
    slow.release.set()
    await wait_log(logs, "model_build_discarded")
    assert watcher.catalog.names() == []
    assert not find(logs, "model_added")


async def test_open_plane_is_announced_at_start_and_loud_when_reachable_from_elsewhere(
    start: Start, logs: Logs
) -> None:
    watcher, _ = await start()
    line = find(logs, "discovery_plane_open")[0]
    assert line["log_level"] == "info" and line["exposed"] == []  # loopback: this machine only
    assert line["addresses"] == watcher.addresses
    assert reachable_from_elsewhere("tcp://0.0.0.0:7555") and reachable_from_elsewhere("tcp://10.0.0.5:1")
    assert not reachable_from_elsewhere("tcp://127.0.0.1:7555") and not reachable_from_elsewhere("ipc:///x")
    DiscoveryLog("dynamo").plane_open(["tcp://0.0.0.0:7555"], bound=True)
    loud = find(logs, "discovery_plane_open")[-1]
    assert loud["log_level"] == "error" and loud["exposed"] == ["tcp://0.0.0.0:7555"]


async def test_curve_binds_each_instance_to_its_key(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard, context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    server_public, server_secret = generate_keys(tmp_path / "server", "frontend")
    allow = tmp_path / "allow"
    allow.mkdir()
    clients = {}
    for name in ("alice", "mallory"):
        public, secret = generate_keys(tmp_path / name, name)
        (allow / public.name).write_bytes(public.read_bytes())  # both may announce
        clients[name] = ClientCurve.load(secret, server_public)
    watcher, alice = await start(curve=ServerCurve.load(server_secret, allow), peer_curve=clients["alice"])
    assert not find(logs, "discovery_plane_open")
    mallory = Peer(context, watcher.addresses[0], clients["mallory"])
    try:
        await mallory.subscribed()
        raw = card_bytes(k3_card)
        await alice.publish(announce("owned", 1, raw))
        await wait_log(logs, "instance_added", instance_id="owned")
        await mallory.publish(encode_message(Withdraw(instance_id="owned", seq=99, sent_ms=0)))
        line = await wait_log(logs, "curve_key_mismatch")
        assert line["instance_id"] == "owned"
        assert line["action"] == "withdraw"
        assert line["bound_key"] == clients["alice"].public_key.decode()
        assert line["offered_key"] == clients["mallory"].public_key.decode()
        assert watcher.registry.model_of("owned") == "kimi-k3-demo"
        assert not find(logs, "instance_removed")
    finally:
        mallory.close()


@dataclass
class AliceAllowed:
    """A CURVE plane whose allow-list holds one client key, alice's."""

    server_public: Path
    server: ServerCurve
    alice: ClientCurve
    alice_public: Path  # its copy in the allow-list directory


def alice_allowed(tmp_path: Path) -> AliceAllowed:
    server_public, server_secret = generate_keys(tmp_path / "server", "frontend")
    alice_public, alice_secret = generate_keys(tmp_path / "alice", "alice")
    allow = tmp_path / "allow"
    allow.mkdir()
    (allow / alice_public.name).write_bytes(alice_public.read_bytes())
    return AliceAllowed(
        server_public,
        ServerCurve.load(server_secret, allow),
        ClientCurve.load(alice_secret, server_public),
        allow / alice_public.name,
    )


async def test_curve_refuses_keys_outside_the_allow_list(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard, context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    plane = alice_allowed(tmp_path)
    _, eve_secret = generate_keys(tmp_path / "eve", "eve")
    watcher, alice = await start(curve=plane.server, peer_curve=plane.alice)
    eve = Peer(context, watcher.addresses[0], ClientCurve.load(eve_secret, plane.server_public))
    try:
        for seq in range(1, 4):
            await eve.publish(announce("eve", seq, card_bytes(k3_card)))
        await alice.publish(announce("alice", 1, card_bytes(k3_card)))
        await wait_log(logs, "instance_added", instance_id="alice")
        assert watcher.registry.model_of("eve") is None
        assert watcher.counters["messages"] == 1
    finally:
        eve.close()


async def test_a_key_removed_from_the_allow_list_takes_its_instances_with_it(
    start: Start, logs: Logs, k3_card: ModelDeploymentCard, tmp_path: Path
) -> None:
    plane = alice_allowed(tmp_path)
    watcher, alice = await start(curve=plane.server, peer_curve=plane.alice)
    await alice.publish(announce("alice", 1, card_bytes(k3_card), ttl_ms=60_000))
    await wait_log(logs, "instance_added", instance_id="alice")
    plane.alice_public.unlink()
    revoked = await wait_log(logs, "curve_keys_revoked")
    assert revoked["keys"] == [plane.alice.public_key.decode()]
    await wait_log(logs, "instance_removed", instance_id="alice", reason="revoked")
    assert watcher.registry.model_of("alice") is None
    # The connection it already had is still open; what it sends on it is refused.
    await alice.publish(announce("alice", 2, card_bytes(k3_card), ttl_ms=60_000))
    await wait_log(logs, "card_rejected", reason="revoked_key")
    assert watcher.registry.model_of("alice") is None
