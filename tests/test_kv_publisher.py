"""The engine-side KV-event publisher, read by hand-written pyzmq SUB and DEALER sockets on loopback.

The frames are checked against the wire itself (msgpack decoded to plain lists and dicts), not
through the project's own decoder, so a shared misreading of the wire cannot hide here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from support import kv_wire
from support.kv_wire import END, REMOVED_FIELDS, STORED_FIELDS, be8, full
from support.logs import TIMEOUT_S

from dynamo_prep.engines.mock.kv_publisher import KvEventPublisher
from dynamo_prep.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

context = kv_wire.context  # a fixture


def stored(n: int) -> BlockStored:
    return BlockStored(
        block_hashes=[n], parent_block_hash=n - 1 if n else None, token_ids=[n] * 4, block_size=4
    )


@pytest.fixture
async def publisher(context: zmq.asyncio.Context) -> AsyncIterator[KvEventPublisher]:
    publisher = KvEventPublisher(topic="kv-events", context=context)
    publisher.start()
    yield publisher
    await publisher.close()


def dealer(context: zmq.asyncio.Context, address: str | None) -> zmq.asyncio.Socket:
    assert address is not None
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


async def recv(socket: zmq.asyncio.Socket) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(socket.recv_multipart(), TIMEOUT_S)
    return frames


async def replay(socket: zmq.asyncio.Socket, start: int) -> list[list[bytes]]:
    """Everything one replay request brings, up to and including the end marker."""
    await socket.send_multipart([b"", be8(start)])
    replies = []
    while True:
        frames = await recv(socket)
        replies.append(frames)
        if frames[2:3] == [END]:
            return replies


async def subscribed_sub(context: zmq.asyncio.Context, publisher: KvEventPublisher) -> zmq.asyncio.Socket:
    """A SUB that provably receives: publish probes until one arrives (PUB has no subscribe signal)."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(publisher.endpoints.endpoint)
    while not await socket.poll(10):
        publisher.publish([])
    while await socket.poll(50):  # drain the probes
        await socket.recv_multipart()
    return socket


@pytest.mark.parametrize("shape", ["map", "array"])
async def test_live_frames_are_the_vllm_wire(context: zmq.asyncio.Context, shape: Any) -> None:
    publisher = KvEventPublisher(topic="kv-events", data_parallel_rank=1, shape=shape, context=context)
    kv = publisher.start()
    try:
        assert kv.endpoint.startswith("tcp://127.0.0.1:") and not kv.endpoint.endswith(":*")
        assert kv.replay_endpoint is not None and kv.replay_endpoint != kv.endpoint
        assert kv.topic == "kv-events"
        sub = await subscribed_sub(context, publisher)
        first = publisher.next_seq
        assert (
            publisher.publish([stored(7), BlockRemoved(block_hashes=[b"\x01" * 32]), AllBlocksCleared()])
            == first
        )
        topic, seq, payload = await recv(sub)
        assert topic == b"kv-events" and seq == be8(first)
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 1
        if shape == "map":  # every field of vLLM's structs, in its order (it requires lora_id, ...)
            block = {"block_hashes": [7], "parent_block_hash": 6, "token_ids": [7] * 4, "block_size": 4}
            assert events == [
                full("BlockStored", STORED_FIELDS, **block),
                full("BlockRemoved", REMOVED_FIELDS, block_hashes=[b"\x01" * 32]),
                {"type": "AllBlocksCleared"},
            ]
            assert [list(event) for event in events] == [
                ["type", *STORED_FIELDS], ["type", *REMOVED_FIELDS], ["type"]
            ]  # fmt: skip
        else:
            assert events == [
                ["BlockStored", [7], 6, [7] * 4, 4, None, None],
                ["BlockRemoved", [b"\x01" * 32], None],
                ["AllBlocksCleared"],
            ]
    finally:
        await publisher.close()


async def test_replay_answers_every_buffered_batch_then_the_end(
    context: zmq.asyncio.Context, publisher: KvEventPublisher
) -> None:
    payloads = {}
    sub = await subscribed_sub(context, publisher)
    base = publisher.next_seq
    for n in range(5):
        publisher.publish([stored(n)])
        _, seq, payload = await recv(sub)
        payloads[int.from_bytes(seq, "big")] = payload
    client = dealer(context, publisher.endpoints.replay_endpoint)
    replies = await replay(client, base + 2)
    assert replies == [
        *([b"", b"kv-events", be8(s), payloads[s]] for s in range(base + 2, base + 5)),
        [b"", b"", END, b""],
    ]
    assert await replay(client, base + 5) == [[b"", b"", END, b""]], "nothing at or past the next seq"


async def test_ring_buffer_keeps_the_last_buffer_steps(context: zmq.asyncio.Context) -> None:
    publisher = KvEventPublisher(buffer_steps=4, context=context)
    kv = publisher.start()
    try:
        for n in range(10):
            assert publisher.publish([stored(n)]) == n, "seq counts from 0"
        replies = await replay(dealer(context, kv.replay_endpoint), 0)
        assert [frames[2] for frames in replies] == [*(be8(s) for s in range(6, 10)), END]
        assert all(frames[1] == b"" for frames in replies), "topic '' is an empty frame"
    finally:
        await publisher.close()


async def test_garbage_requests_are_dropped_and_service_goes_on(
    context: zmq.asyncio.Context, publisher: KvEventPublisher
) -> None:
    publisher.publish([stored(0)])
    client = dealer(context, publisher.endpoints.replay_endpoint)
    await client.send_multipart([b"", b"\x00\x01"])  # a 2-byte seq
    await client.send_multipart([b"", be8(0), b"extra"])  # four frames at the ROUTER
    await client.send_multipart([be8(0)])  # no empty delimiter
    huge = dealer(context, publisher.endpoints.replay_endpoint)
    await huge.send_multipart([b"", b"\x00" * 4096])  # above the ROUTER's MAXMSGSIZE: disconnected
    replies = await replay(client, 0)
    assert [frames[2] for frames in replies] == [be8(0), END], "one answer, to the valid request only"


async def test_a_large_replay_arrives_whole_while_publishing_goes_on(
    context: zmq.asyncio.Context, publisher: KvEventPublisher
) -> None:
    """10,000 batches exceed the default HWMs: ROUTER_MANDATORY waits instead of dropping."""
    first = publisher.next_seq
    for n in range(10_000):
        publisher.publish([stored(n)])
    client = dealer(context, publisher.endpoints.replay_endpoint)
    await client.send_multipart([b"", be8(first)])
    seqs = []
    while True:
        frames = await recv(client)
        if frames[2] == END:
            break
        seqs.append(int.from_bytes(frames[2], "big"))
        if len(seqs) == 100:
            publisher.publish([stored(-1)])  # the engine's loop is not held up by the replay
    assert seqs == list(range(first, first + 10_000))
    assert publisher.next_seq == first + 10_001


async def test_close_is_idempotent_and_publish_after_close_is_refused(context: zmq.asyncio.Context) -> None:
    publisher = KvEventPublisher(replay_endpoint=None, context=context)
    kv = publisher.start()
    assert kv.replay_endpoint is None
    publisher.publish([stored(0)])
    await publisher.close()
    await publisher.close()
    with pytest.raises(RuntimeError):
        publisher.publish([stored(1)])
