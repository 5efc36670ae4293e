"""The KV-event subscriber on real ZeroMQ sockets over loopback, against publishers written by hand.

Each raw publisher's batches store one block whose hash is the batch's seq, so a recording sink's
history spells out what was applied, in which order, and where the instance was reset.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from support import kv_wire
from support.kv_wire import (
    RawKvPublisher,
    RecordingSink,
    batch,
    be8,
    block_hash,
    cleared,
    removed,
    seq_batch,
    stored,
)
from support.logs import TIMEOUT_S, Logs, find, until

from dynamo_prep.engines.mock.kv_publisher import KvEventPublisher
from dynamo_prep.protocol.discovery import Instance, KvEventsEndpoint
from dynamo_prep.protocol.kv_events import (
    MAX_BATCH_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from dynamo_prep.routing.metrics import KvMetrics
from dynamo_prep.routing.subscriber import MAX_FRAME_BYTES, KvEventSubscriber

context = kv_wire.context  # fixture

REPLAY_TIMEOUT_S = 0.5


def instance(instance_id: str, kv: KvEventsEndpoint | None) -> Instance:
    return Instance(instance_id=instance_id, endpoint="tcp://127.0.0.1:1", kv_events=kv)


def value(metrics: KvMetrics, name: str, **labels: str) -> float:
    sample = metrics.registry.get_sample_value(f"dynamo_frontend_{name}", labels)
    return sample or 0.0


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
async def raw(context: zmq.asyncio.Context) -> AsyncIterator[Callable[..., RawKvPublisher]]:
    """``raw(**kwargs)``: a hand-written publisher, closed after the test."""
    made: list[RawKvPublisher] = []

    def _make(**kwargs: Any) -> RawKvPublisher:
        publisher = RawKvPublisher(context, **kwargs)
        made.append(publisher)
        return publisher

    yield _make
    for publisher in made:
        await publisher.close()


Start = Callable[..., tuple[KvEventSubscriber, RecordingSink]]


@pytest.fixture
async def start(logs: Logs, context: zmq.asyncio.Context) -> AsyncIterator[Start]:
    """``start(**kwargs)`` -> (subscriber, sink): a running subscriber, closed after the test."""
    running: list[tuple[KvEventSubscriber, asyncio.Task[None]]] = []

    def _start(**kwargs: Any) -> tuple[KvEventSubscriber, RecordingSink]:
        sink = RecordingSink()
        kwargs.setdefault("replay_timeout_s", REPLAY_TIMEOUT_S)
        subscriber = KvEventSubscriber(
            sink, metrics=KvMetrics(CollectorRegistry()), context=context, **kwargs
        )
        running.append((subscriber, asyncio.get_running_loop().create_task(subscriber.run())))
        return subscriber, sink

    yield _start
    for subscriber, task in running:
        subscriber.close()
        await asyncio.wait_for(task, 10)


async def caught_up(subscriber: KvEventSubscriber, instance_id: str) -> None:
    """The first replay of an instance is over."""
    follower = subscriber.follower(instance_id)
    assert follower is not None
    await until(lambda: not follower.replaying, f"{instance_id} caught up")


# -- the wire, both shapes -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["map", "array"])
@pytest.mark.parametrize("kind", ["int", "bytes"])
@pytest.mark.parametrize("topic", [b"", b"kv-events"])
async def test_live_events_in_both_shapes_hash_types_and_topics(
    raw: Callable[..., RawKvPublisher], start: Start, shape: Any, kind: Any, topic: bytes
) -> None:
    publisher = raw(topic=topic, replay=False)
    subscriber, sink = start()
    assert subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    h = [block_hash(n, kind) for n in range(4)]
    publisher.publish(batch([stored(h[:2], None, shape=shape), stored(h[2:], h[1], shape=shape)]))
    publisher.publish(batch([removed([h[3]], shape=shape), cleared(shape=shape)], dp_rank=0))
    await until(lambda: len(sink.events("w0")) == 4, "four events")
    first, second, gone, wiped = sink.events("w0")
    assert isinstance(first, BlockStored) and first.block_hashes == h[:2] and first.parent_block_hash is None
    assert first.token_ids == list(range(8)) and first.block_size == 4 and first.medium == "GPU"
    assert isinstance(second, BlockStored) and second.parent_block_hash == h[1]
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [h[3]]
    assert isinstance(wiped, AllBlocksCleared)
    metrics = subscriber.metrics
    assert value(metrics, "kv_events_applied_total", kind="stored") == 2
    assert value(metrics, "kv_blocks_applied_total", kind="stored") == 4
    assert value(metrics, "kv_blocks_applied_total", kind="removed") == 1
    assert value(metrics, "kv_events_applied_total", kind="cleared") == 1
    assert value(metrics, "kv_instances_followed") == 1


async def test_other_topics_are_not_applied(raw: Callable[..., RawKvPublisher], start: Start) -> None:
    """``kv`` subscribes by prefix, so ``kv-2`` reaches the socket; only the exact topic applies."""
    publisher = raw(topic=b"kv", replay=False)
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    publisher.send([b"kv-2", be8(0), seq_batch(0)])
    publisher.publish(seq_batch(0))
    await until(lambda: sink.history("w0") == [0], "seq 0 applied once")
    assert value(subscriber.metrics, "kv_events_rejected_total", reason="other_topic") == 1


# -- catch-up, order, duplicates -----------------------------------------------------------------


@pytest.mark.parametrize("old_replay_form", [False, True])
async def test_late_subscriber_catches_up_from_replay_before_live(
    raw: Callable[..., RawKvPublisher], start: Start, logs: Logs, old_replay_form: bool
) -> None:
    """A frontend (re)start: the replay is applied first, live batches that arrive meanwhile wait."""
    publisher = raw(mode="hold", old_replay_form=old_replay_form)
    for seq in range(50):
        publisher.publish(seq_batch(seq))  # nobody listens yet: only the replay buffer has them
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    await until(lambda: publisher.requests == [0], "the catch-up request from seq 0")
    for _ in range(10):
        publisher.publish(seq_batch(publisher.next_seq))
    follower = subscriber.follower("w0")
    assert follower is not None
    await until(lambda: len(follower.pending) == 10, "live batches buffered during the replay")
    assert sink.calls == []
    publisher.release()  # the ROUTER now answers 0..59: 50..59 overlap the buffered live ones
    await until(lambda: sink.history("w0") == list(range(60)), "0..59 once each, in order")
    publisher.publish(seq_batch(60))
    await until(lambda: sink.history("w0") == list(range(61)), "live after the catch-up")
    metrics = subscriber.metrics
    assert value(metrics, "kv_duplicate_batches_total") == 10
    assert value(metrics, "kv_replays_total", outcome="filled") == 1
    assert value(metrics, "kv_instance_resets_total", reason="gap") == 0
    finished = find(logs, "kv_replay_finished", instance_id="w0")
    assert finished and finished[0]["outcome"] == "filled" and finished[0]["batches"] == 60
    assert find(logs, "kv_events_subscribed", instance_id="w0")


async def test_truncated_catch_up_takes_what_the_buffer_holds(
    raw: Callable[..., RawKvPublisher], start: Start
) -> None:
    publisher = raw(keep=5)
    for seq in range(20):
        publisher.publish(seq_batch(seq))
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await until(lambda: sink.history("w0") == list(range(15, 20)), "the 5 buffered batches")
    assert value(subscriber.metrics, "kv_replays_total", outcome="truncated") == 1
    assert sink.resets("w0") == 0


async def test_without_replay_endpoint_starts_from_first_live(
    raw: Callable[..., RawKvPublisher], start: Start
) -> None:
    publisher = raw(replay=False)
    publisher.publish(seq_batch(0), drop=True)
    publisher.publish(seq_batch(1), drop=True)
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    for _ in range(3):
        publisher.publish(seq_batch(publisher.next_seq))
    await until(lambda: sink.history("w0") == [2, 3, 4], "from the first live batch on")
    assert value(subscriber.metrics, "kv_replays_total") == 0


# -- gaps ----------------------------------------------------------------------------------------


async def test_gap_is_filled_by_replay(raw: Callable[..., RawKvPublisher], start: Start, logs: Logs) -> None:
    publisher = raw()
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    await caught_up(subscriber, "w0")
    for seq in range(5):
        publisher.publish(seq_batch(seq))
    await until(lambda: sink.history("w0") == list(range(5)), "0..4")
    publisher.publish(seq_batch(5), drop=True)
    publisher.publish(seq_batch(6), drop=True)
    publisher.publish(seq_batch(7))
    await until(lambda: sink.history("w0") == list(range(8)), "5 and 6 replayed before 7")
    assert publisher.requests == [0, 5]
    assert value(subscriber.metrics, "kv_gaps_total") == 1
    assert value(subscriber.metrics, "kv_replays_total", outcome="filled") == 2
    gap = find(logs, "kv_gap_detected", instance_id="w0")
    assert gap and gap[0]["expected_seq"] == 5 and gap[0]["seq"] == 7
    assert find(logs, "kv_replay_started", instance_id="w0", reason="gap", start_seq=5)


async def test_gap_without_replay_endpoint_resets(raw: Callable[..., RawKvPublisher], start: Start) -> None:
    publisher = raw(replay=False)
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    for seq in range(3):
        publisher.publish(seq_batch(seq))
    publisher.publish(seq_batch(3), drop=True)
    publisher.publish(seq_batch(4))
    publisher.publish(seq_batch(5))
    await until(lambda: sink.history("w0") == [0, 1, 2, "reset", 4, 5], "reset at the gap, then resync")
    assert value(subscriber.metrics, "kv_instance_resets_total", reason="gap_without_replay") == 1


async def test_replay_that_no_longer_buffers_the_gap_resets(
    raw: Callable[..., RawKvPublisher], start: Start
) -> None:
    publisher = raw(keep=3)
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    await caught_up(subscriber, "w0")
    for seq in range(3):
        publisher.publish(seq_batch(seq))
    for seq in range(3, 8):
        publisher.publish(seq_batch(seq), drop=True)
    publisher.publish(seq_batch(8))  # the ROUTER now holds 6..8 only
    await until(lambda: sink.history("w0") == [0, 1, 2, "reset", 6, 7, 8], "resync from what is there")
    assert value(subscriber.metrics, "kv_replays_total", outcome="reset") == 1
    publisher.publish(seq_batch(9))
    await until(lambda: sink.seqs("w0") == [6, 7, 8, 9], "live goes on")


async def test_silent_replay_resets_within_the_deadline(
    raw: Callable[..., RawKvPublisher], start: Start, logs: Logs
) -> None:
    publisher = raw(mode="silent")
    subscriber, sink = start()
    started = time.monotonic()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    publisher.publish(seq_batch(0))
    await until(lambda: sink.history("w0") == ["reset", 0], "timeout, reset, then the buffered live")
    assert time.monotonic() - started >= REPLAY_TIMEOUT_S
    publisher.publish(seq_batch(1), drop=True)
    publisher.publish(seq_batch(2))
    await until(lambda: sink.history("w0") == ["reset", 0, "reset", 2], "a second silent replay")
    assert value(subscriber.metrics, "kv_replays_total", outcome="timeout") == 2
    assert find(logs, "kv_instance_reset", instance_id="w0", reason="replay_timeout")


async def test_replay_answering_garbage_resets(raw: Callable[..., RawKvPublisher], start: Start) -> None:
    publisher = raw(mode="garbage")
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    publisher.publish(seq_batch(0))
    publisher.publish(seq_batch(1))
    await until(lambda: sink.seqs("w0") == [0, 1], "resync from live after the garbage replay")
    metrics = subscriber.metrics
    assert value(metrics, "kv_replays_total", outcome="reset") == 1
    assert value(metrics, "kv_events_rejected_total", reason="frame_count") == 1


# -- restarts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("replay", [True, False])
async def test_publisher_restart_resets_and_starts_over(
    raw: Callable[..., RawKvPublisher], start: Start, replay: bool
) -> None:
    publisher = raw(replay=replay)
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    if replay:
        await caught_up(subscriber, "w0")
    for seq in range(6):
        publisher.publish(seq_batch(seq))
    await until(lambda: sink.history("w0") == list(range(6)), "0..5")
    publisher.restart()
    for seq in range(3):
        publisher.publish(seq_batch(seq))
    await until(lambda: sink.history("w0") == [*range(6), "reset", 0, 1, 2], "reset, then the new 0..2")
    assert value(subscriber.metrics, "kv_instance_resets_total", reason="publisher_restart") == 1


async def test_two_subscribers_build_the_same_history(context: zmq.asyncio.Context, start: Start) -> None:
    """One frontend follows from the start, another starts late: the same events, in the same order."""
    publisher = KvEventPublisher(context=context)
    kv = publisher.start()
    try:
        early, early_sink = start()
        early.add(instance("w0", kv))
        await caught_up(early, "w0")
        hashes = iter(range(1_000_000))
        for _ in range(30):
            publisher.publish([stored([next(hashes)], None)])
        late, late_sink = start()
        late.add(instance("w0", kv))
        await caught_up(late, "w0")
        # Live batches sent before a SUB's subscription reaches the PUB are lost to it; the next
        # one shows the gap and the replay fills it. So publish until both have applied 60 (their
        # subscriptions are then in place), and then both must hold every batch published.
        deadline = time.monotonic() + TIMEOUT_S
        while min(len(early_sink.events("w0")), len(late_sink.events("w0"))) < 60:
            assert time.monotonic() < deadline, "timed out publishing to two subscribers"
            publisher.publish([stored([next(hashes)], None)])
            await asyncio.sleep(0.005)
        published = list(range(publisher.next_seq))
        await until(lambda: early_sink.history("w0") == late_sink.history("w0") == published, "both complete")
        assert early_sink.resets("w0") == late_sink.resets("w0") == 0
    finally:
        await publisher.close()


# -- garbage -------------------------------------------------------------------------------------


GARBAGE_FRAMES = [
    [b"\x07" * 37],  # one frame
    [b"", be8(0)],  # two frames
    [b"", be8(0), seq_batch(0), b"extra"],  # four frames
    [b"", b"\x00\x01", seq_batch(0)],  # a 2-byte seq
    [b"", b"\x01" * 9, b"\x02" * 64],  # a 9-byte seq
]
# Events nested past msgspec's recursion limit, inside a batch that is otherwise fine.
TOO_DEEP = b"\x93" + msgspec.msgpack.encode(12.5) + b"\x91" + b"\x91" * 100_000 + b"\x00\xc0"


async def test_garbage_never_touches_another_instance(
    raw: Callable[..., RawKvPublisher], start: Start, logs: Logs
) -> None:
    bad = raw(replay=False)
    good = raw()
    subscriber, sink = start()
    subscriber.add(instance("bad", bad.kv_events))
    subscriber.add(instance("good", good.kv_events))
    await bad.wait_subscribed()
    await good.wait_subscribed()
    await caught_up(subscriber, "good")
    for frames in GARBAGE_FRAMES:
        bad.send(frames)
        good.publish(seq_batch(good.next_seq))
    # Payloads with a valid seq: each consumes its seq, the good events among them still apply.
    keep = stored([block_hash(1000, "int")], None)
    payloads = [
        random.Random(7).randbytes(200),  # random bytes (they read as an int: invalid)
        b"\xc1",  # a reserved msgpack byte
        TOO_DEEP,
        msgspec.msgpack.encode({"not": "a batch"}),
        batch([{"type": "BlockMoved", "block_hashes": [1]}, keep]),  # unknown event type
        batch([["BlockTeleported", [1]], keep]),  # unknown, old array form
        batch([stored([1, 2], None, tokens=[1, 2, 3]), keep]),  # not a whole number of blocks
        batch([stored([1.5], None), keep]),  # a float hash
        batch([stored(["abc"], None), keep]),  # a str hash
        batch([stored([b"x" * 100], None), keep]),  # a 100-byte hash
        batch([stored([1], None, block_size=0, tokens=[]), keep]),  # block size 0
        b"\x00" * (MAX_BATCH_BYTES + 1),  # too large (but below libzmq's frame limit)
    ]
    for payload in payloads:
        bad.publish(payload)
        good.publish(seq_batch(good.next_seq))
    total = len(GARBAGE_FRAMES) + len(payloads)
    await until(lambda: len(sink.history("good")) == total, "every good batch")
    follower = subscriber.follower("bad")
    assert follower is not None
    await until(lambda: follower.last == bad.next_seq - 1, "every seq of the bad instance consumed")
    assert sink.history("good") == list(range(total)), "the other instance is untouched"
    assert sink.resets("good") == sink.resets("bad") == 0
    assert all(isinstance(e, BlockStored) and e.block_hashes == [1000] for e in sink.events("bad"))
    assert len(sink.events("bad")) == 7, "each batch's good event still applied"
    metrics = subscriber.metrics
    reasons = ("frame_count", "bad_seq", "undecodable", "too_deep", "invalid", "unknown_event", "too_large")
    rejected = {reason: value(metrics, "kv_events_rejected_total", reason=reason) for reason in reasons}
    assert rejected == {
        "frame_count": 3,
        "bad_seq": 2,
        "undecodable": 1,
        "too_deep": 1,
        "invalid": 7,
        "unknown_event": 2,
        "too_large": 1,
    }
    lines = find(logs, "kv_event_rejected", instance_id="bad")
    by_reason: dict[str, int] = {}
    for line in lines:
        by_reason[line["reason"]] = by_reason.get(line["reason"], 0) + 1
        assert {"detail", "suppressed", "source"} <= set(line)
    assert by_reason["invalid"] < 7, "rate-limited: at most one line per reason per second"
    assert not find(logs, "kv_event_rejected", instance_id="good")


async def test_frames_above_the_libzmq_limit_are_dropped(
    raw: Callable[..., RawKvPublisher], start: Start
) -> None:
    """libzmq disconnects a peer that sends a frame above MAXMSGSIZE; the SUB reconnects."""
    bad = raw(replay=False)
    good = raw(replay=False)
    subscriber, sink = start()
    subscriber.add(instance("bad", bad.kv_events))
    subscriber.add(instance("good", good.kv_events))
    await bad.wait_subscribed()
    await good.wait_subscribed()
    bad.publish(b"\x00" * (MAX_FRAME_BYTES + 1))
    good.publish(seq_batch(0))
    await until(lambda: bad.subscriptions >= 2, "the bad instance's SUB reconnected")
    bad.publish(seq_batch(bad.next_seq))
    good.publish(seq_batch(1))
    await until(lambda: sink.history("bad") == [1] and sink.history("good") == [0, 1], "both go on")


async def test_a_flood_is_shared_fairly(raw: Callable[..., RawKvPublisher], start: Start) -> None:
    """A flooding instance yields every ``max_drain`` messages: the other's batch is not starved."""
    flood = raw(replay=False)
    other = raw(replay=False)
    subscriber, sink = start(max_drain=16)
    subscriber.add(instance("flood", flood.kv_events))
    subscriber.add(instance("other", other.kv_events))
    await flood.wait_subscribed()
    await other.wait_subscribed()
    for _ in range(5000):
        flood.publish(seq_batch(flood.next_seq))
    other.publish(seq_batch(0))
    await until(lambda: sink.history("other") == [0], "the other instance's batch")
    assert len(sink.history("flood")) < 5000, "applied before the flood was drained"
    await until(lambda: len(sink.history("flood")) == 5000, "the whole flood")


# -- membership ----------------------------------------------------------------------------------


async def test_remove_resets_and_stops_following(
    raw: Callable[..., RawKvPublisher], start: Start, logs: Logs
) -> None:
    publisher = raw()
    subscriber, sink = start()
    subscriber.add(instance("w0", publisher.kv_events))
    await publisher.wait_subscribed()
    publisher.publish(seq_batch(0))
    await until(lambda: sink.history("w0") == [0], "seq 0")
    subscriber.remove("w0")
    assert sink.history("w0") == [0, "reset"]
    assert subscriber.instance_ids == frozenset()
    assert value(subscriber.metrics, "kv_instances_followed") == 0
    await until(lambda: publisher.unsubscriptions == 1, "the SUB closed")
    assert find(logs, "kv_events_unsubscribed", instance_id="w0", reason="removed")
    subscriber.remove("w0")  # twice: nothing more
    assert sink.history("w0") == [0, "reset"]


async def test_add_rules(raw: Callable[..., RawKvPublisher], start: Start, logs: Logs) -> None:
    publisher = raw()
    subscriber, sink = start()
    assert not subscriber.add(instance("plain", None)), "no kv_events: not followed"
    assert subscriber.add(instance("w0", publisher.kv_events))
    assert subscriber.add(instance("w0", publisher.kv_events)), "the same addresses: a no-op"
    await publisher.wait_subscribed()
    await caught_up(subscriber, "w0")
    assert publisher.requests == [0]
    other = raw()
    assert subscriber.add(instance("w0", other.kv_events)), "new addresses: followed anew"
    assert sink.history("w0") == ["reset"]
    await other.wait_subscribed()
    assert not subscriber.add(instance("w1", KvEventsEndpoint(endpoint="tcp://127.0.0.1:x")))
    assert find(logs, "kv_events_connect_failed", instance_id="w1")
    assert subscriber.instance_ids == frozenset({"w0"})
