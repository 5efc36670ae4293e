"""The engines' KV-event wire written by hand, for tests of the KV transport on loopback.

Nothing here uses ``dynamo_prep.protocol.kv_events`` to build frames: payloads are plain lists and
dicts encoded with msgpack, as vLLM (maps with ``"type"``) or older vLLM (arrays, tag first) send
them, so the tests check the project's reading of the wire against the wire itself.

* ``stored`` / ``removed`` / ``cleared`` / ``batch``: events and payloads in either shape (the
  required fields only, as older engines send them); ``full``: an event map with every field of
  vLLM's struct in vLLM's order (``STORED_FIELDS``, ``REMOVED_FIELDS``), as we publish them.
* ``RawKvPublisher``: an XPUB (so a test can wait for the subscription instead of sleeping) and a
  ROUTER whose replies the test controls (answer, hold, stay silent, answer garbage).
* ``RecordingSink`` / ``RecordingChannel``: test doubles of ``KvEventSink`` and ``ReplayChannel``
  that record every call in order; ``ManualClock``: a clock the test moves.
* Fixture ``context`` (a fresh ZeroMQ context): import it into a test module to use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import pytest
import zmq
import zmq.asyncio

from dynamo_prep.protocol.discovery import KvEventsEndpoint
from dynamo_prep.protocol.kv_events import BlockStored, KVEvent
from support.logs import until

Shape = Literal["map", "array"]
ReplayMode = Literal["answer", "hold", "silent", "garbage"]
LOOPBACK = "tcp://127.0.0.1:*"
END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def be8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def block_hash(n: int, kind: Literal["int", "bytes"]) -> int | bytes:
    """An engine block hash: an int, or 32 bytes (vLLM's default sha256 hashes)."""
    return n if kind == "int" else n.to_bytes(32, "big")


def stored(
    hashes: Sequence[Any], parent: Any, *, block_size: int = 4, shape: Shape = "map", tokens: Any = None
) -> Any:
    """A BlockStored event; token ids default to a whole number of blocks."""
    token_ids = list(range(len(hashes) * block_size)) if tokens is None else tokens
    if shape == "map":
        return {
            "type": "BlockStored",
            "block_hashes": list(hashes),
            "parent_block_hash": parent,
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
        }
    return ["BlockStored", list(hashes), parent, token_ids, block_size, None, "GPU"]


# vLLM's event fields in vLLM's order (vllm/distributed/kv_events.py, 0.33; 0.32 lacks the last).
STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
    "ownership", "session_id", "lookahead_token_ids",
)  # fmt: skip
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def full(tag: str, fields: Sequence[str], **values: Any) -> dict[str, Any]:
    """An event map with every one of ``fields``, in order (None where ``values`` has none)."""
    return {"type": tag, **{name: values.get(name) for name in fields}}


def removed(hashes: Sequence[Any], *, shape: Shape = "map") -> Any:
    if shape == "map":
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}
    return ["BlockRemoved", list(hashes), "GPU"]


def cleared(*, shape: Shape = "map") -> Any:
    return {"type": "AllBlocksCleared"} if shape == "map" else ["AllBlocksCleared"]


def batch(events: Sequence[Any], *, ts: float = 12.5, dp_rank: int | None = None) -> bytes:
    """``msgpack([ts, events, data_parallel_rank])``: KVEventBatch is array_like in every version."""
    return msgspec.msgpack.encode([ts, list(events), dp_rank])


def seq_batch(seq: int, *, shape: Shape = "map", kind: Literal["int", "bytes"] = "int") -> bytes:
    """A batch that stores one block whose hash is ``seq``: the sink's history then spells the seqs."""
    parent = block_hash(seq - 1, kind) if seq else None
    return batch([stored([block_hash(seq, kind)], parent, shape=shape)])


@dataclass
class RecordingSink:
    """Every ``apply`` and ``reset``, in call order."""

    calls: list[tuple[str, str, list[KVEvent]]] = field(default_factory=list)

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        self.calls.append(("apply", instance_id, list(events)))

    def reset(self, instance_id: str) -> None:
        self.calls.append(("reset", instance_id, []))

    def history(self, instance_id: str) -> list[Any]:
        """One instance's calls as ``seq`` (the first stored hash of a batch) or ``"reset"``."""
        out: list[Any] = []
        for op, iid, events in self.calls:
            if iid != instance_id:
                continue
            if op == "reset":
                out.append("reset")
            else:
                out.extend(_as_int(e.block_hashes[0]) for e in events if isinstance(e, BlockStored))
        return out

    def seqs(self, instance_id: str) -> list[int]:
        """The stored seqs since the instance's last reset."""
        history = self.history(instance_id)
        cut = max((i for i, item in enumerate(history) if item == "reset"), default=-1)
        return history[cut + 1 :]

    def events(self, instance_id: str) -> list[KVEvent]:
        return [e for op, iid, events in self.calls if op == "apply" and iid == instance_id for e in events]

    def resets(self, instance_id: str) -> int:
        return sum(1 for op, iid, _ in self.calls if op == "reset" and iid == instance_id)


@dataclass
class RecordingChannel:
    """What was asked of the replay channel, and how often a replay was given up."""

    requests: list[int] = field(default_factory=list)
    cancels: int = 0

    def request(self, start_seq: int) -> None:
        self.requests.append(start_seq)

    def cancel(self) -> None:
        self.cancels += 1


class ManualClock:
    """``time.monotonic`` as the test decides (``now`` moves only when the test moves it)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _as_int(value: int | bytes) -> int:
    return value if isinstance(value, int) else int.from_bytes(value, "big")


class RawKvPublisher:
    """An engine's KV publisher written by hand: XPUB for live frames, ROUTER for replays.

    ``publish`` keeps every batch for replays (``keep`` most recent) and sends it unless told to
    drop it (a gap). The replay ROUTER answers as the wire says (``mode="answer"``), or waits for
    ``release()`` (``"hold"``), never answers (``"silent"``) or answers garbage (``"garbage"``).
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        topic: bytes = b"",
        replay: bool = True,
        mode: ReplayMode = "answer",
        keep: int = 10_000,
        old_replay_form: bool = False,
    ) -> None:
        self.topic = topic
        self.mode: ReplayMode = mode
        self.keep = keep
        self.old_replay_form = old_replay_form
        self.buffer: dict[int, bytes] = {}
        self.requests: list[int] = []
        self.next_seq = 0
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(LOOPBACK)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.subscriptions = 0
        self.unsubscriptions = 0
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(LOOPBACK)
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._released = asyncio.Event()
        self._tasks = [asyncio.get_running_loop().create_task(self._count_subscriptions())]
        if self.router is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._serve(self.router)))

    @property
    def kv_events(self) -> KvEventsEndpoint:
        return KvEventsEndpoint(
            endpoint=self.endpoint, replay_endpoint=self.replay_endpoint, topic=self.topic.decode()
        )

    async def wait_subscribed(self, count: int = 1) -> None:
        await until(lambda: self.subscriptions >= count, f"{count} subscription(s) at the raw publisher")

    def publish(self, payload: bytes, *, drop: bool = False, seq: int | None = None) -> int:
        """Buffer (and unless ``drop``, send) one batch with the next seq, or with ``seq``."""
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        self.buffer[seq] = payload
        for old in [s for s in self.buffer if s <= seq - self.keep]:
            del self.buffer[old]
        if not drop:
            self.send([self.topic, be8(seq), payload])
        return seq

    def send(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames, zmq.NOBLOCK)

    def restart(self) -> None:
        """A new engine behind the same addresses: seq starts over, the old buffer is gone."""
        self.buffer.clear()
        self.next_seq = 0

    def release(self) -> None:
        self._released.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)

    async def _count_subscriptions(self) -> None:
        while True:
            message = await self.pub.recv()
            if message[:1] == b"\x01":
                self.subscriptions += 1
            elif message[:1] == b"\x00":
                self.unsubscriptions += 1

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        while True:
            identity, *request = await router.recv_multipart()
            self.requests.append(int.from_bytes(request[-1], "big") if request else -1)
            if self.mode == "silent":
                continue
            if self.mode == "hold":
                await self._released.wait()
            if self.mode == "garbage":
                await router.send_multipart([identity, b"", b"\xff\x00garbage"])
                continue
            start = self.requests[-1]
            for seq in sorted(s for s in self.buffer if s >= start):
                await router.send_multipart([identity, *self._reply(seq, self.buffer[seq])])
            await router.send_multipart([identity, *self._end()])

    def _reply(self, seq: int, payload: bytes) -> list[bytes]:
        if self.old_replay_form:
            return [b"", be8(seq), payload]
        return [b"", self.topic, be8(seq), payload]

    def _end(self) -> list[bytes]:
        return [b"", END, b""] if self.old_replay_form else [b"", b"", END, b""]
