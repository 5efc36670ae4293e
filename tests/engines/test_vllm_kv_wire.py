"""The KV-event wire against vLLM itself: vLLM reads what we publish, and we read what vLLM publishes.

Our frames (``encode_batch``, as the mock's publisher encodes them, over the events the mock's
prefix cache emits and over hand-built ones) are decoded the way vLLM's own subscriber does
(``msgspec.msgpack.Decoder(type=KVEventBatch)`` with vLLM's structs) and must give the same values;
batches encoded by vLLM (its publisher's ``msgspec.msgpack.Encoder``, and its ``ZmqEventPublisher``
on a socket) must decode with ``decode_batch`` to the same values. Needs vLLM: ``make test-engines``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vllm

from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ImageSpan,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    parse_live,
    parse_replay,
    replay_request,
)

BS = 4
TIMEOUT_S = 20.0
VLLM_DECODER = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)  # as vLLM's subscriber decodes
VLLM_ENCODER = msgspec.msgpack.Encoder()  # as ZmqEventPublisher packs each batch
PAIRS: dict[type, type] = {
    BlockStored: vllm.BlockStored,
    BlockRemoved: vllm.BlockRemoved,
    AllBlocksCleared: vllm.AllBlocksCleared,
}


def plain(value: Any) -> Any:
    """A field's value with tuples as lists (msgpack has arrays only)."""
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    return value


def assert_same_events(ours: Sequence[KVEvent], theirs: Sequence[Any]) -> None:
    """The same kinds, in order, with equal values in every field vLLM's struct has."""
    assert [PAIRS[type(event)] for event in ours] == [type(event) for event in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        for name in type(other).__struct_fields__:
            assert plain(getattr(mine, name)) == plain(getattr(other, name)), (type(other).__name__, name)


def cache_events(hash_kind: Any) -> list[KVEvent]:
    """What the mock's cache emits: stores with and without image extra keys, evictions, a clear."""
    cache = PagedPrefixCache(BS, 3, hash_kind=hash_kind)
    cache.admit("a", list(range(3 * BS)), [ImageSpan("sha256:cat", 2, 3), ImageSpan("sha256:dog", 5, 1)])
    cache.release("a")
    cache.admit("b", list(range(100, 100 + 2 * BS)))  # evicts two blocks of "a"
    cache.release("b")
    cache.admit("c", list(range(100, 100 + 3 * BS)))  # a store chained to a cached parent
    cache.release("c")
    assert cache.reset()
    return cache.take_events()


HAND_BUILT: list[KVEvent] = [
    BlockStored(block_hashes=[0, 2**64 - 1], parent_block_hash=None, token_ids=[1] * 8, block_size=4),
    BlockStored(
        block_hashes=[b"\x01" * 32],
        parent_block_hash=b"\x02" * 32,
        token_ids=[5, 6],
        block_size=2,
        lora_id=7,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[["adapter", ["sha256:img", -1], "salt"]],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        ownership="tier-1",
        session_id="session-9",
    ),
    BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[9], block_size=1, extra_keys=[None]),
    BlockRemoved(block_hashes=[1, 2]),
    BlockRemoved(block_hashes=[b"\x03" * 32], medium="GPU", group_idx=0, locality="REMOTE", ownership="x"),
    AllBlocksCleared(),
]


def test_our_structs_have_vllms_fields_in_vllms_order_and_tags() -> None:
    for ours, theirs in PAIRS.items():
        fields = theirs.__struct_fields__
        assert ours.__struct_fields__[: len(fields)] == fields, ours.__name__
        assert ours.__struct_config__.tag == theirs.__struct_config__.tag
        assert ours.__struct_config__.tag_field == theirs.__struct_config__.tag_field
    batch_fields = vllm.KVEventBatch.__struct_fields__
    assert KVEventBatch.__struct_fields__ == batch_fields and vllm.KVEventBatch.__struct_config__.array_like


@pytest.mark.parametrize("hash_kind", ["bytes", "int"])
@pytest.mark.parametrize("rank", [None, 0, 3])
def test_every_frame_the_mock_publishes_decodes_in_vllm_with_the_same_values(
    hash_kind: str, rank: int | None
) -> None:
    events = cache_events(hash_kind)
    assert {type(event) for event in events} == set(PAIRS)
    assert any(isinstance(e, BlockStored) and e.extra_keys for e in events)
    assert any(isinstance(e, BlockStored) and e.parent_block_hash is not None for e in events)
    decoded = VLLM_DECODER.decode(encode_batch(KVEventBatch(ts=12.5, events=events, data_parallel_rank=rank)))
    assert (decoded.ts, decoded.data_parallel_rank) == (12.5, rank)
    assert_same_events(events, decoded.events)


def test_every_field_we_can_set_reaches_vllm() -> None:
    decoded = VLLM_DECODER.decode(encode_batch(KVEventBatch(ts=1.0, events=HAND_BUILT)))
    assert_same_events(HAND_BUILT, decoded.events)
    assert decoded.events[1].extra_keys == [("adapter", ["sha256:img", -1], "salt")]


def test_one_event_at_a_time_and_an_empty_batch_decode_in_vllm() -> None:
    for event in HAND_BUILT:
        decoded = VLLM_DECODER.decode(encode_batch(KVEventBatch(ts=0.0, events=[event])))
        assert_same_events([event], decoded.events)
    assert VLLM_DECODER.decode(encode_batch(KVEventBatch(ts=0.0, events=[]))).events == []


def vllm_events() -> list[Any]:
    """vLLM's own structs: required fields only, every field, both hash kinds."""
    return [
        vllm.BlockStored(
            block_hashes=[b"\x04" * 32, b"\x05" * 32],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium=vllm.MEDIUM_GPU,
            lora_name=None,
        ),
        vllm.BlockStored(
            block_hashes=[11],
            parent_block_hash=10,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=2,
            medium=vllm.MEDIUM_CPU,
            lora_name="adapter",
            extra_keys=[("adapter", ("sha256:img", 0), "salt")],
            group_idx=0,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=64,
            locality="LOCAL",
            ownership="tier-1",
            session_id="s",
        ),
        vllm.BlockRemoved(block_hashes=[11, 2**63], medium=vllm.MEDIUM_GPU),
        vllm.BlockRemoved(block_hashes=[b"\x04" * 32], medium=None, group_idx=1, locality="REMOTE"),
        vllm.AllBlocksCleared(),
    ]


def test_what_vllm_encodes_decodes_with_ours() -> None:
    theirs = vllm_events()
    payload = VLLM_ENCODER.encode(vllm.KVEventBatch(ts=3.25, events=theirs, data_parallel_rank=1))
    decoded = decode_batch(payload)
    assert not decoded.skipped
    assert (decoded.batch.ts, decoded.batch.data_parallel_rank) == (3.25, 1)
    assert_same_events(decoded.batch.events, theirs)
    again = VLLM_DECODER.decode(encode_batch(decoded.batch))  # and back, unchanged
    assert_same_events(decoded.batch.events, again.events)


# -- vLLM's own publisher, on sockets -----------------------------------------------------------


@pytest.fixture
def publisher() -> Iterator[tuple[vllm.ZmqEventPublisher, str, str]]:
    with tempfile.TemporaryDirectory(prefix="vllm-kv-") as directory:
        live, replay = f"ipc://{Path(directory) / 'live'}", f"ipc://{Path(directory) / 'replay'}"
        pub = vllm.ZmqEventPublisher(0, endpoint=live, replay_endpoint=replay, topic="kv-events")
        try:
            yield pub, live, replay
        finally:
            pub.shutdown()


def _until(poll: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not poll():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {TIMEOUT_S}s waiting for {what}")


def test_vllms_publisher_frames_live_and_replayed_decode_with_ours(
    publisher: tuple[vllm.ZmqEventPublisher, str, str],
) -> None:
    pub, live, replay = publisher
    context = zmq.Context.instance()
    sub, dealer = context.socket(zmq.SUB), context.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(live)
        dealer.connect(replay)

        def heard() -> bool:  # a PUB has no subscription signal: publish probes until one arrives
            pub.publish(vllm.KVEventBatch(ts=0.0, events=[]))
            return bool(sub.poll(10))

        _until(heard, "the SUB to hear vLLM's PUB")
        sent = vllm.KVEventBatch(ts=5.0, events=vllm_events())
        pub.publish(sent)
        frames: list[bytes] = []

        def received() -> bool:  # skip the probes still in flight
            frames[:] = sub.recv_multipart() if sub.poll(100) else []
            return bool(frames) and bool(decode_batch(parse_live(frames)[2]).batch.events)

        _until(received, "the published batch")
        topic, seq, payload = parse_live(frames)
        assert topic == b"kv-events"
        decoded = decode_batch(payload)
        assert not decoded.skipped and decoded.batch.data_parallel_rank == 0
        assert_same_events(decoded.batch.events, sent.events)

        dealer.send_multipart(replay_request(seq))
        assert dealer.poll(int(TIMEOUT_S * 1000))
        replayed = parse_replay(dealer.recv_multipart())
        assert replayed.seq == seq and replayed.payload == payload
        assert dealer.poll(int(TIMEOUT_S * 1000))
        assert parse_replay(dealer.recv_multipart()).end
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
