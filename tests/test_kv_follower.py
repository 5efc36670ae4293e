"""The ordering rules of one instance, without sockets: frames in, sink calls and replay requests out.

The loopback tests (test_kv_subscriber.py) show the rules on real sockets; these pin the cases a
socket test cannot stage deterministically: a replay racing a late subscription, a restart in the
middle of a replay, the live buffer overflowing, a failing sink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.kv_wire import END, ManualClock, RecordingChannel, RecordingSink, be8, seq_batch

from dynamo_prep.protocol.kv_events import KVEvent
from dynamo_prep.routing.follower import InstanceFollower
from dynamo_prep.routing.metrics import KvMetrics

TIMEOUT_S = 2.0


@dataclass
class Rig:
    follower: InstanceFollower
    sink: RecordingSink
    channel: RecordingChannel
    clock: ManualClock
    metrics: KvMetrics

    def live(self, seq: int, payload: bytes | None = None) -> None:
        self.follower.on_live([b"", be8(seq), seq_batch(seq) if payload is None else payload])

    def replayed(self, *seqs: int) -> None:
        for seq in seqs:
            self.follower.on_replay([b"", b"", be8(seq), seq_batch(seq)])

    def end(self) -> None:
        self.follower.on_replay([b"", b"", END, b""])

    @property
    def history(self) -> list[Any]:
        return self.sink.history("w0")

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(f"dynamo_frontend_{name}", labels) or 0.0


def rig(*, replay: bool = True, max_pending: int = 100, sink: Any = None) -> Rig:
    sink = sink or RecordingSink()
    channel, clock, metrics = RecordingChannel(), ManualClock(), KvMetrics(CollectorRegistry())
    follower = InstanceFollower(
        "w0",
        sink,
        topic=b"",
        replay=channel if replay else None,
        metrics=metrics,
        clock=clock,
        timeout_s=TIMEOUT_S,
        max_pending=max_pending,
    )
    follower.start()
    return Rig(follower, sink, channel, clock, metrics)


def test_catch_up_then_buffered_live_without_duplicates() -> None:
    r = rig()
    assert r.channel.requests == [0]
    r.live(3)
    r.live(4)
    assert r.history == [] and len(r.follower.pending) == 2
    r.replayed(0, 1, 2, 3)
    r.end()
    assert r.history == [0, 1, 2, 3, 4] and not r.follower.pending
    assert r.count("kv_duplicate_batches_total") == 1


def test_a_replay_that_applied_something_but_left_a_gap_is_followed_by_another() -> None:
    """Live batches sent before the subscription reached the publisher are in neither stream."""
    r = rig()
    r.live(6)  # 4 and 5 were published after the replay's snapshot, before our subscription
    r.replayed(0, 1, 2, 3)
    r.end()
    assert r.channel.requests == [0, 4] and r.history == [0, 1, 2, 3]
    r.replayed(4, 5, 6)
    r.end()
    assert r.history == [0, 1, 2, 3, 4, 5, 6] and r.sink.resets("w0") == 0
    assert r.count("kv_replays_total", outcome="filled") == 2


def test_a_replay_that_brings_nothing_while_a_gap_stays_resets() -> None:
    r = rig()
    r.end()
    r.live(0)
    r.live(3)
    assert r.channel.requests == [0, 1]
    r.live(4)
    r.end()  # nothing from 1 on: the gap cannot be filled
    assert r.history == [0, "reset", 3, 4]
    assert r.count("kv_instance_resets_total", reason="replay_incomplete") == 1
    assert r.count("kv_replays_total", outcome="reset") == 1 and r.channel.cancels == 1


def test_restart_in_the_middle_of_a_replay_abandons_it() -> None:
    r = rig()
    r.end()
    for seq in range(5):
        r.live(seq)
    r.live(7)  # gap: replay from 5
    r.replayed(5)
    r.live(0)  # the live seq went back: a new publisher
    assert r.channel.cancels == 1 and r.channel.requests == [0, 5, 0]
    assert r.count("kv_replays_total", outcome="abandoned") == 1
    r.replayed(0)
    r.end()
    assert r.history == [0, 1, 2, 3, 4, 5, "reset", 0]


def test_live_buffer_overflow_gives_the_replay_up() -> None:
    r = rig(max_pending=3)
    for seq in range(4):
        r.live(seq)
    assert r.history == ["reset", 0, 1, 2, 3] and not r.follower.replaying
    assert r.count("kv_instance_resets_total", reason="pending_overflow") == 1
    r.replayed(0)  # the given-up replay's late reply: the real DEALER is gone, this is a stray
    assert r.count("kv_events_rejected_total", reason="unexpected_replay") == 1


def test_replay_deadline_is_for_silence() -> None:
    r = rig()
    r.clock.now += TIMEOUT_S - 0.1
    r.replayed(0)
    r.clock.now += TIMEOUT_S - 0.1
    r.follower.expire()
    assert r.follower.replaying, "it is answering: the deadline moved"
    r.clock.now += 0.2
    r.follower.expire()
    assert not r.follower.replaying and r.history == [0, "reset"]
    assert r.count("kv_replays_total", outcome="timeout") == 1


def test_without_replay_a_gap_resets_and_duplicates_are_restarts() -> None:
    r = rig(replay=False)
    r.live(5)
    r.live(7)
    r.live(7)
    assert r.history == [5, "reset", 7, "reset", 7]
    assert r.count("kv_instance_resets_total", reason="publisher_restart") == 1


@pytest.mark.parametrize("payload", [b"\xc1", b"\x93\xa1x\x90\xc0"])
def test_an_unusable_batch_consumes_its_seq(payload: bytes) -> None:
    r = rig(replay=False)
    r.live(0)
    r.live(1, payload)
    r.live(2)
    assert r.history == [0, 2] and r.follower.last == 2 and r.count("kv_gaps_total") == 0


def test_a_failing_sink_is_counted_and_the_stream_goes_on() -> None:
    class Failing(RecordingSink):
        attempts = 0

        def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
            self.attempts += 1
            if self.attempts == 2:
                raise RuntimeError("index bug")
            super().apply(instance_id, events)

    r = rig(replay=False, sink=Failing())
    for seq in range(3):
        r.live(seq)
    assert r.history == [0, 2] and r.follower.last == 2
    assert r.count("kv_events_rejected_total", reason="sink_error") == 1
