"""Fuzz target of the KV subscriber's frame handling, shared by ``tests/test_kv_fuzz.py`` (a seeded
slice) and ``benchmarks/fuzz.py`` (>= 10,000 cases), like ``strategies.py``'s targets.

An example is a run of steps fed to one ``InstanceFollower``: live messages, replay replies and the
clock moving on. Frames are any mix of the wire done right (both event shapes, int and bytes
hashes, the old and new replay forms), wrong (frame counts, seq widths, topics, end markers) and
random bytes, with seqs drawn from a small range so that order, duplicates, gaps and restarts all
happen. The sink notes the follower's ``last`` at each ``apply``: the seq of the batch applied.

Outcomes: ``"ok"`` when at least one batch reached the sink, ``"rejected:KvEventDecodeError"`` when
every message was refused. Never an exception; and always:

* between two resets, applied seqs strictly increase (nothing twice, nothing out of order);
* live batches wait only while a replay is outstanding, and never more than the bound;
* a replay is asked from 0 or from the last applied seq + 1, and only with a replay channel;
* every refusal is counted under a documented reason, replay outcomes are documented labels, and
  every log line is a documented event naming the instance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import structlog
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from strategies import ByteMutation, Outcome, byte_mutations
from support.kv_wire import ManualClock, RecordingChannel

from dynamo_prep.protocol.kv_events import BlockStored, KVEvent
from dynamo_prep.routing.follower import MAX_PENDING_BATCHES, InstanceFollower
from dynamo_prep.routing.metrics import REPLAY_OUTCOMES, KvMetrics

TOPIC = b"kv"
END = (-1).to_bytes(8, "big", signed=True)
# KvEventDecodeError's reasons, and the follower's own.
DOCUMENTED_REASONS = frozenset(
    {
        "frame_count",
        "bad_seq",
        "too_large",
        "undecodable",
        "too_deep",
        "invalid",
        "too_many_events",
        "unknown_event",
    }
    | {"other_topic", "unexpected_replay", "sink_error"}
)
LOG_EVENTS = frozenset(
    {"kv_event_rejected", "kv_gap_detected", "kv_replay_started", "kv_replay_finished", "kv_instance_reset"}
)

# -- steps ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """A batch for one seq: well formed (hash = seq), with extra events, or mutated into garbage."""

    shape: Literal["map", "array"]
    kind: Literal["int", "bytes"]
    extra: tuple[Any, ...] = ()
    mutation: ByteMutation | None = None

    def encode(self, seq: int) -> bytes:
        block = seq if self.kind == "int" else seq.to_bytes(8, "big")
        if self.shape == "map":
            event: Any = {
                "type": "BlockStored",
                "block_hashes": [block],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
            }
        else:
            event = ["BlockStored", [block], None, [1, 2], 2, None, None]
        payload = msgspec.msgpack.encode([1.5, [event, *self.extra], None])
        return payload if self.mutation is None else self.mutation.apply(payload)


@dataclass(frozen=True)
class Step:
    """One input: a live message, a replay reply, or the clock moving ``seconds`` on."""

    channel: Literal["live", "replay", "tick"]
    frames: tuple[bytes, ...] = ()
    seconds: float = 0.0


_extra_events = st.lists(
    st.one_of(
        st.just({"type": "BlockRemoved", "block_hashes": [7]}),
        st.just(["AllBlocksCleared"]),
        st.just({"type": "Teleported"}),
        st.just({"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1]}),
        st.just({"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None}),
        st.just(["BlockRemoved", ["not a hash"], None]),
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.binary(max_size=8),
        st.just(msgspec.Raw(b"\x91" * 1000 + b"\x00")),  # nested too deeply
    ),
    max_size=3,
).map(tuple)

payloads = st.builds(
    Payload,
    shape=st.sampled_from(["map", "array"]),
    kind=st.sampled_from(["int", "bytes"]),
    extra=_extra_events,
    mutation=st.one_of(st.none(), st.none(), st.none(), byte_mutations),
)
seqs = st.integers(0, 12)
random_frames = st.lists(st.binary(max_size=24), max_size=5).map(tuple)


@st.composite
def live_steps(draw: st.DrawFn) -> Step:
    seq = draw(seqs)
    topic = draw(st.sampled_from([TOPIC, TOPIC, TOPIC, b"", b"kv2"]))
    seq_frame = draw(st.sampled_from([seq.to_bytes(8, "big")] * 4 + [seq.to_bytes(4, "big"), b""]))
    frames = (topic, seq_frame, draw(payloads).encode(seq))
    return Step("live", draw(st.one_of(st.just(frames), st.just(frames), st.just(frames[:2]), random_frames)))


@st.composite
def replay_steps(draw: st.DrawFn) -> Step:
    seq = draw(seqs)
    payload = draw(payloads).encode(seq)
    be8 = seq.to_bytes(8, "big")
    frames = draw(
        st.sampled_from(
            [
                (b"", TOPIC, be8, payload),
                (b"", TOPIC, be8, payload),
                (b"", be8, payload),
                (b"", b"", END, b""),
                (b"", END, b""),
                (b"x", TOPIC, be8, payload),
                (b"", TOPIC, be8[:3], payload),
            ]
        )
    )
    return Step("replay", draw(st.one_of(st.just(frames), st.just(frames), random_frames)))


steps = st.one_of(
    live_steps(),
    live_steps(),
    replay_steps(),
    st.builds(Step, channel=st.just("tick"), seconds=st.floats(0, 3)),
)


@dataclass(frozen=True)
class FollowInput:
    with_replay: bool
    steps: tuple[Step, ...]


follow_inputs = st.builds(
    FollowInput, with_replay=st.booleans(), steps=st.lists(steps, max_size=40).map(tuple)
)

# -- the check -----------------------------------------------------------------------------------


@dataclass
class _Sink:
    """The sink's calls as the seq being applied (the follower's ``last``) and ``"reset"``."""

    history: list[Any] = field(default_factory=list)
    follower: InstanceFollower | None = None

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        assert events, "an empty batch reached the sink"
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        assert self.follower is not None and self.follower.last is not None
        self.history.append(self.follower.last)

    def reset(self, instance_id: str) -> None:
        self.history.append("reset")


def check_follow(data: FollowInput) -> Outcome:
    with structlog.testing.capture_logs() as logs:
        outcome = _follow(data)
    for line in logs:
        assert line["event"] in LOG_EVENTS and line["instance_id"] == "w0", line
    return outcome


def _follow(data: FollowInput) -> Outcome:
    sink, channel, clock = _Sink(), RecordingChannel(), ManualClock()
    metrics = KvMetrics(CollectorRegistry())
    follower = InstanceFollower(
        "w0", sink, topic=TOPIC, replay=channel if data.with_replay else None, metrics=metrics, clock=clock
    )
    sink.follower = follower
    follower.start()
    feed: dict[str, Callable[[list[bytes]], None]] = {"live": follower.on_live, "replay": follower.on_replay}
    for step in data.steps:
        requested = len(channel.requests)
        if step.channel == "tick":
            clock.now += step.seconds
            follower.expire()
        else:
            feed[step.channel](list(step.frames))
        _check_state(follower, channel, data.with_replay, asked=len(channel.requests) > requested)
    _check_history(sink.history)
    _check_labels(metrics)
    applied = any(item != "reset" for item in sink.history)
    return "ok" if applied else "rejected:KvEventDecodeError"


def _check_state(
    follower: InstanceFollower, channel: RecordingChannel, with_replay: bool, *, asked: bool
) -> None:
    assert follower.replaying == (follower.deadline() is not None)
    assert follower.replaying or not follower.pending, "live batches wait only during a replay"
    assert len(follower.pending) <= MAX_PENDING_BATCHES
    if not with_replay:
        assert not channel.requests and not follower.replaying
    if asked and follower.replaying:  # nothing applies while a replay is outstanding
        start, last = channel.requests[-1], follower.last
        assert start == 0 or (last is not None and start == last + 1), f"replay from {start} after {last}"


def _check_history(history: list[Any]) -> None:
    previous: int | None = None
    for item in history:
        if item == "reset":
            previous = None
            continue
        assert previous is None or item > previous, f"seq {item} applied after {previous}: {history}"
        previous = item


def _check_labels(metrics: KvMetrics) -> None:
    for family in metrics.registry.collect():
        for sample in family.samples:
            if "reason" in sample.labels and family.name.endswith("rejected"):
                assert sample.labels["reason"] in DOCUMENTED_REASONS, sample
            if "outcome" in sample.labels:
                assert sample.labels["outcome"] in REPLAY_OUTCOMES, sample


TARGETS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], Outcome]]] = {
    "kv_subscriber_frames": (follow_inputs, check_follow),
}
