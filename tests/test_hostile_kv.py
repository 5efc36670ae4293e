"""Hostile input on the KV plane's data path (issue 20, rows 4, 5 and 16): every event costs O(its own
size), an instance holds at most its engine's capacity, long batches are applied in slices that
yield to the loop, the buffers are bounded in bytes, and skipped events are counted, not kept.

Costs are shown by work bounds (lines of the index executed, the most blocks applied between two
yields, allocation peaks), never by timing. ``benchmarks/kv_hostile.py`` has the measured figures.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from support import kv_wire
from support.kv_wire import RawKvPublisher, RecordingChannel, be8
from support.logs import until
from support.plane import DynamoProcess, start_dynamo
from test_hostile import K3, Target, k3_card

import dynamo_prep.routing.index as index_module
from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.discovery import Instance
from dynamo_prep.protocol.kv_events import (
    MAX_EVENT_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ImageSpan,
    KVEvent,
    KVEventBatch,
    KvEventDecodeError,
    decode_batch,
    encode_batch,
)
from dynamo_prep.routing.follower import SKIPPED_EVENT_BLOCKS, InstanceFollower, PendingBudget
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import BUCKET_ENTRIES, DROP_PER_APPLY, MAX_INSTANCE_BLOCKS, KvIndex, _Table
from dynamo_prep.routing.metrics import KvMetrics
from dynamo_prep.routing.subscriber import KvEventSubscriber

context = kv_wire.context  # fixture
BS = 4


def stored(first: int, blocks: int, parent: int | None = None, *, block_size: int = BS) -> BlockStored:
    """``blocks`` chained blocks with engine hashes ``first``, ``first + 1``, ... (tokens from them)."""
    hashes = list(range(first, first + blocks))
    tokens = [hashes[i // block_size] for i in range(blocks * block_size)]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size)


def payload(events: Sequence[KVEvent]) -> bytes:
    return encode_batch(KVEventBatch(ts=1.0, events=list(events)))


def lines_run(call: Callable[[], object], module: Any = index_module) -> int:
    """Lines of ``module`` executed by ``call``: its work, counted."""
    filename = module.__file__
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename == filename else None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


# -- row 4: an event costs its own size, whatever the instance holds -------------------------------


def same_cost(large: int, small: int) -> bool:
    """Equal but for a few lines (a table bucket made on first use, or found empty)."""
    return abs(large - small) <= 100


def held_chains(chains: int, length: int = 10) -> KvIndex:
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    index.set_capacity("w", 100_000)  # its tables' few buckets all exist after the first chains
    for chain in range(chains):
        index.apply("w", [stored(chain * 1000, length)])
    return index


def removals(heads: int) -> list[KVEvent]:
    """Each removes the first block of a chain before its descendants (they go along)."""
    return [BlockRemoved(block_hashes=[chain * 1000]) for chain in range(heads)]


def test_a_removal_costs_the_blocks_it_drops_not_the_blocks_held() -> None:
    """Issue 20 row 4: 500 such removals against 100k held blocks held the loop 10.1 s (each one
    walked every block of the instance). The same removals cost the same against 10x more blocks."""
    small, large = held_chains(100), held_chains(1000)
    cost_small = lines_run(lambda: small.apply("w", removals(50)))
    cost_large = lines_run(lambda: large.apply("w", removals(50)))
    assert small.counters.orphaned_blocks == large.counters.orphaned_blocks == 50 * 9
    assert len(small) == 500 and len(large) == 9500
    assert same_cost(cost_large, cost_small), "the cost does not depend on the blocks held"
    never_stored = [BlockRemoved(block_hashes=[10**9 + n]) for n in range(50)]
    assert lines_run(lambda: large.apply("w", never_stored)) < 30 * 50  # a few dozen lines each
    assert large.counters.unknown_removed_blocks == 50


def test_a_long_chain_removed_at_its_root_is_dropped_a_bounded_part_per_call() -> None:
    """The descendants go leaves first, at most DROP_PER_APPLY per apply call: the instance holds
    a prefix of the chain at every step (a match never claims more than it holds)."""
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    chain = stored(0, 3 * DROP_PER_APPLY)
    index.apply("w", [chain])
    hashes = request_block_hashes(chain.token_ids, BS, [])
    held = [len(index)]
    index.apply("w", [BlockRemoved(block_hashes=[0])])
    held.append(len(index))
    while len(index):
        assert index.match(hashes) == {"w": len(index)}, "a prefix, always"
        index.apply("w", [])
        held.append(len(index))
    assert all(a - b <= DROP_PER_APPLY for a, b in itertools.pairwise(held))
    assert len(held) >= 3 and index.counters.orphaned_blocks == 3 * DROP_PER_APPLY - 1


def test_a_reused_engine_hash_costs_the_blocks_it_drops() -> None:
    small, large = held_chains(100), held_chains(1000)
    relinks = [stored(chain * 1000, 1) for chain in range(20)]  # same hash, other tokens: the chain goes
    for event in relinks:
        event.token_ids[0] += 1
    assert same_cost(
        lines_run(lambda: small.apply("w", relinks)), lines_run(lambda: large.apply("w", relinks))
    )
    assert large.counters.orphaned_blocks == 20 * 9


# -- the per-instance bound ---------------------------------------------------------------------


def test_an_instance_holds_at_most_its_engines_capacity() -> None:
    refused: list[tuple[str, int]] = []
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600), on_refused=lambda r, b: refused.append((r, b)))
    index.set_capacity("w", 100)
    with capture_logs() as logs:
        index.apply("w", [stored(0, 60), stored(60, 60, parent=59), stored(120, 10, parent=119)])
    assert index.blocks_held("w") == 100 and index.counters.over_capacity_blocks == 20
    assert refused == [("over_capacity", 20), ("unknown_parent", 10)]  # the rest chained to a refused block
    assert [line["reason"] for line in logs] == ["over_capacity", "unknown_parent"], "once per reason"
    index.apply("w", [BlockRemoved(block_hashes=list(range(90, 100)))])
    index.apply("w", [stored(90, 10, parent=89)])  # room again: stored
    assert index.blocks_held("w") == 100
    index.reset("w")  # a gap keeps the bound ...
    index.apply("w", [stored(0, 150)])
    assert index.blocks_held("w") == 100
    index.forget("w")  # ... an instance that left does not
    assert index.capacity("w") == MAX_INSTANCE_BLOCKS and index.blocks_held("w") == 0
    index.set_capacity("w", 10**12)
    assert index.capacity("w") == MAX_INSTANCE_BLOCKS, "a card cannot claim more than the hard cap"
    index.set_capacity("w", None)
    assert index.capacity("w") == MAX_INSTANCE_BLOCKS


def test_over_capacity_stores_cost_nothing_past_the_bound() -> None:
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    index.set_capacity("w", 10)
    index.apply("w", [stored(0, 10), stored(50, 1)])  # full: refused, logged (later ones are not)
    one = lines_run(lambda: index.apply("w", [stored(100, 1)]))
    many = lines_run(lambda: index.apply("w", [stored(200, 1000)]))
    assert one == many, "refused before its hashes are computed"
    assert index.counters.over_capacity_blocks == 1002


def test_a_reset_is_at_once_for_matches_and_its_entries_go_a_slice_at_a_time() -> None:
    """A reset (a gap, a publisher restart) or ``AllBlocksCleared`` of an instance holding 2M
    blocks took one step of their size. Matches stop crediting it at once; its entries leave the
    table ``DROP_PER_APPLY`` per call; its bit goes to no other instance until they are all gone."""
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    blocks = 10 * DROP_PER_APPLY
    chain = stored(0, blocks)
    index.apply("a", [chain])
    hashes = request_block_hashes(chain.token_ids, BS, [])
    assert index.match(hashes) == {"a": blocks}
    assert lines_run(lambda: index.reset("a")) < 15 * DROP_PER_APPLY, (
        "one slice (the whole one: 16 lines a block)"
    )
    assert index.match(hashes) == {} and index.blocks_held("a") == 0
    index.apply("b", [stored(0, blocks)])  # the same blocks, at once, by another instance
    assert index.match(hashes) == {"b": blocks}
    index.apply("a", [stored(0, 10)])  # a's old entries are not its new ones
    assert index.match(hashes) == {"b": blocks, "a": 10}
    for _ in range(10):
        index.apply("c", [])
    assert len(index) == blocks, "what b and a hold, the retired entries gone"
    index.apply("c", [stored(10**6, 1)])  # the retired bit is free again: c may get it
    assert index.match(hashes) == {"b": blocks, "a": 10}


def test_all_blocks_cleared_retires_the_blocks_and_keeps_what_follows() -> None:
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    first, second = stored(0, 3 * DROP_PER_APPLY), stored(10**6, 5)
    index.apply("w", [first, AllBlocksCleared(), second])
    assert index.match(request_block_hashes(first.token_ids, BS, [])) == {}
    assert index.match(request_block_hashes(second.token_ids, BS, [])) == {"w": 5}
    assert index.blocks_held("w") == 5 and index.counters.cleared == 1


@pytest.mark.parametrize("keys", ["sequential", "random"])
def test_no_insert_rehashes_more_than_a_few_buckets(keys: str) -> None:
    """A dict of 1.4M entries rehashes all of them in one insert (60 ms; five such tables grew
    together in one slice: 300 ms). A table's buckets reach their rehash sizes one after another,
    whatever the keys (sequential keys fill evenly spread buckets evenly: all at once)."""
    table: _Table[int, int] = _Table(MAX_INSTANCE_BLOCKS)
    rng = random.Random(7)
    sizes = [0] * len(table.buckets)
    worst = 0
    for start in range(0, 200 * 2048, 2048):  # a slice of blocks at a time
        for n in range(start, start + 2048):
            key = n if keys == "sequential" else rng.getrandbits(64)
            table.of(key)[key] = n
        now = [sys.getsizeof(bucket) if bucket is not None else 0 for bucket in table.buckets]
        grown = [
            len(bucket or ()) for bucket, old, new in zip(table.buckets, sizes, now, strict=True) if new > old
        ]
        worst = max(worst, sum(grown))
        sizes = now
    assert sum(len(bucket or ()) for bucket in table.buckets) == 200 * 2048
    assert worst <= 3 * BUCKET_ENTRIES, f"{worst} entries rehashed in one slice"


# -- row 5: long batches in slices --------------------------------------------------------------


class SliceSink:
    """A ``KvEventSink`` in front of a real index that records the blocks of each call."""

    def __init__(self) -> None:
        self.index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
        self.calls: list[int] = []
        self.ticks_seen: list[int] = []
        self.ticks = 0

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        self.calls.append(
            sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored | BlockRemoved))
        )
        self.ticks_seen.append(self.ticks)
        self.index.apply(instance_id, events)

    def reset(self, instance_id: str) -> None:
        self.calls.append(-1)
        self.index.reset(instance_id)


def follower(sink: Any, *, slice_blocks: int | None = 64, budget: PendingBudget | None = None,
             replay: bool = False, metrics: KvMetrics | None = None) -> InstanceFollower:  # fmt: skip
    made = InstanceFollower(
        "w",
        sink,
        topic=b"",
        replay=RecordingChannel() if replay else None,
        metrics=metrics or KvMetrics(CollectorRegistry()),
        clock=lambda: 0.0,
        slice_blocks=slice_blocks,
        budget=budget,
    )
    made.start()
    return made


def test_a_long_batch_is_applied_in_slices_in_order_and_as_a_whole() -> None:
    sink = SliceSink()
    f = follower(sink)
    f.on_live([b"", be8(0), payload([stored(0, 1000), BlockRemoved(block_hashes=[999])])])
    assert f.backlogged and sum(sink.calls) <= 64
    f.on_live([b"", be8(1), payload([stored(5000, 3)])])  # accepted, waits behind the first
    assert f.last == 1
    while f.settle():
        pass
    assert max(sink.calls) <= 64, "one slice: at most slice_blocks blocks per call"
    assert sum(sink.calls) == 1000 + 1 + 3
    whole = KvIndex(BS)
    whole.apply("w", [stored(0, 1000), BlockRemoved(block_hashes=[999])])
    whole.apply("w", [stored(5000, 3)])
    prompt = stored(0, 1000).token_ids
    assert (
        sink.index.match(request_block_hashes(prompt, BS, []))
        == whole.match(request_block_hashes(prompt, BS, []))
        == {"w": 999}
    )
    assert sink.index.blocks_held("w") == whole.blocks_held("w") == 1002


@pytest.mark.parametrize("seed", range(3))
def test_slices_apply_a_busy_cache_exactly_as_whole_batches(seed: int) -> None:
    """Random traffic with eviction, images and garbage events, fed in slices of 3 blocks with more
    batches arriving while some wait: the index ends as the one fed whole batches."""
    rng = random.Random(seed)
    cache = PagedPrefixCache(BS, 40, hash_kind=rng.choice(["int", "bytes"]))
    sink, whole = SliceSink(), KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    f = follower(sink, slice_blocks=3)
    prompts: list[list[int]] = []
    for step in range(200):
        prompt = [rng.randrange(3)] * 8 + [rng.randrange(50_000) for _ in range(rng.randrange(40))]
        prompts.append(prompt)
        images = [ImageSpan("img", 10, 6)] if rng.random() < 0.3 else []
        cache.admit(f"r{step}", prompt, images)
        if step % 3 == 2:
            cache.release(f"r{step - rng.randrange(3)}", [])
        events = cache.take_events()
        whole.apply("w", events)
        data = msgspec.msgpack.decode(payload(events))
        data[1].insert(rng.randrange(len(data[1]) + 1), {"type": "Teleported", "block_hashes": [1]})
        f.on_live([b"", be8(step), msgspec.msgpack.encode(data)])
        for _ in range(rng.randrange(3)):
            f.settle()
    while f.settle():
        pass
    assert sink.index.blocks_held("w") == whole.blocks_held("w") == len(cache)
    for prompt in prompts:
        hashes = request_block_hashes(prompt, BS, [])
        assert sink.index.match(hashes) == whole.match(hashes)
    assert max(sink.calls) <= 3


def test_a_reset_drops_what_waits() -> None:
    sink = SliceSink()
    f = follower(sink)
    f.on_live([b"", be8(0), payload([stored(0, 1000)])])
    f.on_live([b"", be8(5), payload([stored(7000, 1)])])  # a gap without replay: reset, then this one
    while f.settle():
        pass
    assert -1 in sink.calls
    assert sink.index.blocks_held("w") == 1, "nothing of the batch before the reset applied after it"


async def test_the_subscriber_yields_between_slices(context: zmq.asyncio.Context) -> None:
    """A batch of 100k blocks on a real socket: other tasks run while it is applied."""
    publisher = RawKvPublisher(context, replay=False)
    sink = SliceSink()
    subscriber = KvEventSubscriber(sink, metrics=KvMetrics(CollectorRegistry()), context=context)
    runner = asyncio.get_running_loop().create_task(subscriber.run())

    async def tick() -> None:
        while True:
            sink.ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        subscriber.add(Instance(instance_id="w", endpoint="tcp://127.0.0.1:1", kv_events=publisher.kv_events))
        await publisher.wait_subscribed()
        chained = [stored(n, 20_000, parent=n - 1 if n else None) for n in range(0, 100_000, 20_000)]
        publisher.publish(payload(chained))  # five events of 500 kB, under MAX_EVENT_BYTES
        await until(lambda: sink.index.blocks_held("w") == 100_000, "the whole batch applied")
        assert len(sink.calls) > 10 and max(sink.calls) <= 4096
        assert sink.ticks_seen[-1] > sink.ticks_seen[0], "another task ran while the batch was applied"
    finally:
        ticker.cancel()
        subscriber.close()
        await asyncio.wait_for(runner, 10)
        await publisher.close()


# -- row 5: buffers bounded in bytes ------------------------------------------------------------


def test_the_pending_buffers_of_all_instances_share_one_budget_in_bytes() -> None:
    budget = PendingBudget(limit=1 << 20)
    metrics = KvMetrics(CollectorRegistry())
    sinks = [SliceSink(), SliceSink()]
    a, b = (follower(sink, replay=True, budget=budget, metrics=metrics) for sink in sinks)
    big = payload([stored(0, 5000)])  # about 150 kB
    a.on_live([b"", be8(0), big])
    seq = 1
    while len(a.pending) == seq and budget.used + len(big) <= budget.limit:
        a.on_live([b"", be8(seq), big])
        seq += 1
    assert a.replaying and budget.used <= budget.limit
    b.on_live([b"", be8(0), big])  # past the shared bound: b gives its replay up (a keeps its own)
    assert not b.replaying and a.replaying
    resets = metrics.registry.get_sample_value(
        "dynamo_frontend_kv_instance_resets_total", {"reason": "pending_overflow"}
    )
    assert resets == 1
    while b.settle():
        pass
    assert budget.used == sum(len(batch) for _, batch in a.pending), "b gave back what it applied"
    a.close()
    assert budget.used == 0


def test_a_replay_given_up_while_its_batches_are_buffered_again_strands_none_of_them() -> None:
    """Past the shared budget (here: another instance's accepted work), a batch put back in the
    buffer behind a new replay overflows it: that replay is given up and every batch still applies."""
    budget = PendingBudget(limit=1 << 16)
    metrics = KvMetrics(CollectorRegistry())
    busy = follower(SliceSink(), budget=budget, metrics=metrics)
    sink = SliceSink()
    b = follower(sink, replay=True, budget=budget, metrics=metrics)
    b.on_replay([b"", b"", be8(0), payload([stored(0, 1)])])
    for seq in (2, 3, 4):  # seq 1 is lost: a gap once the catch-up ends
        b.on_live([b"", be8(seq), payload([stored(seq * 10, 1)])])
    busy.on_live([b"", be8(0), payload([stored(0, 5000)])])  # accepted, waits: its bytes over the budget
    assert budget.used > budget.limit
    b.on_replay([b"", b"", kv_wire.END, b""])
    assert not b.replaying and not b.pending and b.last == 4
    assert sink.index.blocks_held("w") == 3, "2, 3 and 4 applied after the reset"


# -- row 16: skipped events are counted, not kept -------------------------------------------------


def garbage_batch(count: int, event: bytes) -> bytes:
    header = b"\xdd" + count.to_bytes(4, "big")
    return b"\x93" + msgspec.msgpack.encode(1.0) + header + event * count + b"\xc0"


def test_a_batch_of_a_million_one_byte_events_is_refused_whole() -> None:
    """Issue 20 row 16: one 1 MB batch of 1,000,000 one-byte events blocked the loop 13.8 s and
    kept an error object per event (RSS 1,577 MB)."""
    data = garbage_batch(1_000_000, b"\x01")
    tracemalloc.start()
    try:
        with pytest.raises(KvEventDecodeError) as refused:
            decode_batch(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.reason == "too_many_events"
    assert peak < len(data), "nothing per event"


def test_an_event_above_max_event_bytes_is_skipped_and_the_rest_of_its_batch_applies() -> None:
    """One event is decoded in one step: 750k blocks in one event took 30 ms, 16 MB 110 ms (and the
    event loop waits up to two such steps)."""
    huge = stored(0, MAX_EVENT_BYTES // 4, block_size=1)  # 5 bytes a hash, 5 a token: 2.5 MB
    decoded = decode_batch(payload([huge, stored(10**9, 3)]))
    assert decoded.skipped_counts == {"too_large": 1}
    assert [len(event.block_hashes) for event in decoded.batch.events] == [3]  # type: ignore[union-attr]


def test_skipped_events_are_a_count_per_reason() -> None:
    unknown = msgspec.msgpack.encode({"type": "X" * 9})  # 16 bytes: as small as events may be
    data = garbage_batch(20_000, unknown)
    tracemalloc.start()
    try:
        decoded = decode_batch(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoded.skipped_counts == {"unknown_event": 20_000} and len(decoded.skipped) == 1
    assert decoded.batch.events == []
    assert peak < 6 * len(data), "O(1) per skipped event: its encoded slice, not an error object"


def test_the_follower_counts_skipped_events_in_slices() -> None:
    metrics = KvMetrics(CollectorRegistry())
    sink = SliceSink()
    f = follower(sink, metrics=metrics)
    unknown = msgspec.msgpack.encode({"type": "X" * 9})
    with capture_logs() as logs:
        f.on_live([b"", be8(0), garbage_batch(20_000, unknown)])
        slices = 1
        while f.settle():
            slices += 1
    assert slices >= 20_000 * SKIPPED_EVENT_BLOCKS // 64, "skipped events take slices too"
    assert (
        metrics.registry.get_sample_value(
            "dynamo_frontend_kv_events_rejected_total", {"reason": "unknown_event"}
        )
        == 20_000
    )
    assert len([line for line in logs if line["event"] == "kv_event_rejected"]) == 1
    assert sink.calls == []


# -- through a real frontend ----------------------------------------------------------------------


@pytest.fixture
def kv_target(tmp_path: Path, procs: list[DynamoProcess]) -> Iterator[Target]:
    """A frontend in kv mode with one real worker (no KV events of its own)."""
    made = Target(tmp_path, procs)
    http = ("--http-host", "127.0.0.1", "--http-port", str(made.port))
    made.frontend = start_dynamo(
        "frontend", "--discovery-bind", made.plane, *http, "--cache-dir", str(tmp_path / "cache"),
        "--router-mode", "kv", log_level="info",
    )  # fmt: skip
    procs.append(made.frontend)
    worker = start_dynamo("worker", "--model-path", K3, "--discovery", made.plane, "--token-delay", "0")
    procs.append(worker)
    made.worker_id = worker.wait_event("worker_started")["instance_id"]
    made.frontend.wait_event("model_added", timeout=30)
    yield made
    made.close()


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_hostile_publisher_is_bounded_by_its_card_and_the_frontend_keeps_serving(kv_target: Target) -> None:
    frontend = kv_target.frontend
    assert frontend is not None
    pub = kv_target.context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        card = k3_card(runtime_config={**k3_card().get("runtime_config", {}), "total_kv_blocks": 1000})
        block_size = card["kv_cache_block_size"]
        announce = {
            **kv_target.announce("hostile", seq=1, endpoint="tcp://127.0.0.1:9", card=card),
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}"},
        }
        followed = lambda: bool(frontend.find("kv_events_subscribed", instance_id="hostile"))  # noqa: E731
        kv_target.flood([announce], followed, "the hostile instance followed")
        big = payload([stored(0, 5_000, block_size=block_size)])  # five times its card's capacity
        junk = garbage_batch(1_000_000, b"\x01")
        seq = 0

        def refused() -> bool:
            nonlocal seq
            for frame in (big, junk):  # a PUB's first messages may be lost: sent until counted
                pub.send_multipart([b"", be8(seq), frame])
                seq += 1
            return (
                metric(kv_target.port, 'dynamo_frontend_kv_blocks_refused_total{reason="over_capacity"}') > 0
                and metric(
                    kv_target.port, 'dynamo_frontend_kv_events_rejected_total{reason="too_many_events"}'
                )
                > 0
            )

        kv_target.flood([], refused, "the over-capacity and too-many-events refusals counted")
        assert frontend.find("kv_event_refused", reason="over_capacity", instance_id="hostile")
        assert kv_target.chat().status_code == 200
        assert kv_target.live_s() < 5
        assert frontend.process.poll() is None
    finally:
        pub.close(linger=0)
