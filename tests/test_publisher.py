"""CardPublisher against real SUB sockets on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from support.plane import SubCollector, tcp_endpoint, write_model_dir

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig, decode_card
from dynamo_prep.discovery.announcing import Announcing
from dynamo_prep.discovery.publisher import CardPublisher, card_payload
from dynamo_prep.discovery.registry import DiscoveryRegistry, InstanceAdded
from dynamo_prep.protocol.discovery import Announce, DiscoveryMessage, KvEventsEndpoint, Withdraw

LONG_HEARTBEAT_S = 30.0


@pytest.fixture
def card(tmp_path: Path) -> ModelDeploymentCard:
    return ModelDeploymentCard.from_model_dir(
        write_model_dir(tmp_path / "Kimi-K3-Test"),
        runtime_config=ModelRuntimeConfig(image_placeholder_token="<|media_pad|>"),
    )


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def bound(collectors: list[SubCollector], endpoint: str) -> SubCollector:
    collector = SubCollector(endpoint, bind=True)
    collectors.append(collector)
    return collector


class Running:
    """A publisher running as a task; ``stop()`` awaits its withdraw and close."""

    def __init__(self, publisher: CardPublisher) -> None:
        self.publisher = publisher
        self.task = asyncio.create_task(publisher.run())

    async def stop(self) -> None:
        await asyncio.wait_for(self.publisher.stop(), 5)
        await asyncio.wait_for(self.task, 5)


def start(card: ModelDeploymentCard, context: zmq.asyncio.Context, *addresses: str, **kw: Any) -> Running:
    settings = {name: kw.pop(name) for name in ("heartbeat_s", "ttl_ms", "legacy_runtime") if name in kw}
    settings.setdefault("heartbeat_s", LONG_HEARTBEAT_S)
    announcing = Announcing(discovery=addresses, **settings)
    publisher = CardPublisher(
        card, endpoint="tcp://127.0.0.1:1", announcing=announcing, context=context, **kw
    )
    return Running(publisher)


async def wait(
    collector: SubCollector, predicate: Callable[[DiscoveryMessage], bool] = lambda m: True, count: int = 1
) -> list[DiscoveryMessage]:
    return await asyncio.to_thread(collector.wait_messages, predicate, count)


def is_announce(message: DiscoveryMessage) -> bool:
    return isinstance(message, Announce)


async def test_announces_on_start_with_the_card(
    card: ModelDeploymentCard, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    address = tcp_endpoint()
    sub = bound(collectors, address)
    running = start(card, context, address, instance_id="worker-1", ttl_ms=1234)
    message = (await wait(sub, is_announce))[0]
    assert isinstance(message, Announce)
    assert message.instance_id == "worker-1"
    assert message.ttl_ms == 1234
    assert message.endpoint == "tcp://127.0.0.1:1"
    decoded = decode_card(message.card)
    assert decoded.card.mdcsum() == card.mdcsum()
    assert decoded.card.runtime_config.image_placeholder_token == "<|media_pad|>"
    assert decoded.legacy == {}
    assert sub.snapshot()[0].topic == b"dynamo_prep.v1.card.dynamo"
    await running.stop()


async def test_heartbeats_with_strictly_increasing_seq(
    card: ModelDeploymentCard, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    address = tcp_endpoint()
    sub = bound(collectors, address)
    running = start(card, context, address, heartbeat_s=0.1)
    announces = await wait(sub, is_announce, count=6)
    await running.stop()
    seqs = [m.seq for m in announces]
    assert seqs == sorted(set(seqs)), seqs
    received = [r.at for r in sub.snapshot()]
    # Six announces (at most one extra for the subscription) need at least four heartbeat periods.
    assert received[5] - received[0] >= 0.3


async def test_late_subscriber_gets_the_card_at_once_on_a_second_address(
    card: ModelDeploymentCard, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    first, second = tcp_endpoint(), tcp_endpoint()
    early = bound(collectors, first)
    running = start(card, context, first, second)
    await wait(early, is_announce)
    late = bound(collectors, second)
    loop = asyncio.get_running_loop()
    joined = loop.time()
    message = (await wait(late, is_announce))[0]
    assert loop.time() - joined < LONG_HEARTBEAT_S / 5
    assert message.instance_id == running.publisher.instance_id
    await running.stop()


async def test_withdraw_on_stop_has_the_next_seq(
    card: ModelDeploymentCard, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    address = tcp_endpoint()
    sub = bound(collectors, address)
    running = start(card, context, address)
    await wait(sub, is_announce)
    await running.stop()
    withdraw = (await wait(sub, lambda m: isinstance(m, Withdraw)))[0]
    last_announce = max(m.seq for m in sub.decoded() if isinstance(m, Announce))
    assert withdraw.instance_id == running.publisher.instance_id
    assert withdraw.seq == running.publisher.seq > last_announce


async def test_stop_before_run_returns_at_once(
    card: ModelDeploymentCard, context: zmq.asyncio.Context
) -> None:
    announcing = Announcing(discovery=(tcp_endpoint(),))
    publisher = CardPublisher(card, endpoint="tcp://127.0.0.1:1", announcing=announcing, context=context)
    await asyncio.wait_for(publisher.stop(), 1)
    await asyncio.wait_for(publisher.run(), 1)
    assert publisher.seq == 0


def test_legacy_payload_carries_the_old_key(tmp_path: Path) -> None:
    legacy_card = ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "old"))
    payload = card_payload(legacy_card, {"expands_image_pad_token": True})
    decoded = decode_card(payload)
    assert decoded.legacy == {"expands_image_pad_token": True}
    assert decoded.card.runtime_config.image_placeholder_token is None
    assert decoded.card.mdcsum() == legacy_card.mdcsum()
    assert card_payload(legacy_card) == card_payload(legacy_card, None)


async def test_legacy_announce_on_the_wire(
    tmp_path: Path, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    legacy_card = ModelDeploymentCard.from_model_dir(write_model_dir(tmp_path / "old"))
    address = tcp_endpoint()
    sub = bound(collectors, address)
    running = start(legacy_card, context, address, legacy_runtime={"expands_image_pad_token": True})
    message = (await wait(sub, is_announce))[0]
    assert isinstance(message, Announce)
    decoded = decode_card(message.card)
    assert decoded.legacy == {"expands_image_pad_token": True}
    assert decoded.card.mdcsum() == legacy_card.mdcsum()
    await running.stop()


# --- kv_events: the optional address of the instance's KV-event publisher --------------------------

WIRE_V1_KEYS = {"kind", "v", "instance_id", "seq", "sent_ms", "ttl_ms", "endpoint", "card"}
KV = KvEventsEndpoint(endpoint="tcp://10.0.0.7:5557", replay_endpoint="tcp://10.0.0.7:5558", topic="kv")


async def test_an_announce_without_kv_events_has_exactly_the_wire_v1_keys(
    card: ModelDeploymentCard, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    address = tcp_endpoint()
    sub = bound(collectors, address)
    running = start(card, context, address)
    await wait(sub, is_announce)
    await running.stop()
    payload = msgspec.msgpack.decode(sub.snapshot()[0].payload)
    assert set(payload) == WIRE_V1_KEYS


async def test_kv_events_are_in_every_announce_and_reach_the_registry_record(
    card: ModelDeploymentCard, context: zmq.asyncio.Context, collectors: list[SubCollector]
) -> None:
    address = tcp_endpoint()
    sub = bound(collectors, address)
    running = start(card, context, address, kv_events=KV, heartbeat_s=0.1)
    await wait(sub, is_announce, count=2)
    await running.stop()
    received = [r for r in sub.snapshot() if isinstance(r.decode(), Announce)]
    payloads = [msgspec.msgpack.decode(r.payload) for r in received]
    assert all(set(p) == WIRE_V1_KEYS | {"kv_events"} for p in payloads)
    assert payloads[0]["kv_events"] == {
        "endpoint": "tcp://10.0.0.7:5557",
        "replay_endpoint": "tcp://10.0.0.7:5558",
        "topic": "kv",
    }
    registry = DiscoveryRegistry()
    events = registry.apply(received[0].decode(), now=0.0)
    [added] = [event for event in events if isinstance(event, InstanceAdded)]
    assert added.instance.instance_id == running.publisher.instance_id
    assert added.instance.kv_events == KV
