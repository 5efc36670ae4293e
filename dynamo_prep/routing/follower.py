"""One instance's KV-event stream put in order: the subscriber's rules, without sockets.

``InstanceFollower`` takes raw frames (live ``[topic, seq, payload]``, replay replies) and the clock,
and calls the sink and a ``ReplayChannel``; the subscriber owns the sockets around it. Rules:

* Batches are applied in seq order, each at most once. ``last`` is the last applied seq (None: no
  base yet, the next batch is taken as it comes). A batch's seq is consumed even when its payload
  is unusable (counted, logged); bad events are skipped and the rest of the batch applies.
* While a replay is outstanding, live batches are buffered and applied after it, so a replayed old
  batch is never applied after a newer live one. A seq <= ``last`` is a duplicate. The buffer is
  bounded per instance (batches, bytes) and, with every follower of a subscriber, by one shared
  ``PendingBudget`` of bytes; past a bound the replay is given up (``pending_overflow``).
* With ``slice_blocks``, a long batch is applied a slice at a time: ``last`` is the last accepted
  seq, the accepted batches wait in order (their bytes held in the budget) and ``settle`` applies
  about ``slice_blocks`` blocks per call; the owner yields to the event loop between calls and
  reads no more input while ``backlogged``. A reset drops what waits (it would be reset anyway).
* A live seq > ``last + 1`` is a gap: replay from ``last + 1``. Without a replay channel, or when
  the replay cannot fill it (its first batch is past ``last + 1``, it answers garbage, it brings
  nothing while a gap remains, the live buffer overflows, or it is silent for ``timeout_s``), the
  instance is reset and resyncs from what there is (the replayed batches, else the buffered live).
* The live stream of one publisher never goes backwards, so a live seq <= the highest live seq seen
  is a publisher restart: reset, then start over (a replay from 0 when there is a channel).
* Nothing here raises on peer input, and a failing sink is logged and does not stop the stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import msgspec

from dynamo_prep.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KvEventDecodeError,
    decode_event,
    open_batch,
    parse_live,
    parse_replay,
)
from dynamo_prep.routing.eventlog import KvLog
from dynamo_prep.routing.metrics import KvMetrics

__all__ = [
    "APPLY_SLICE_BLOCKS",
    "MAX_PENDING_BATCHES",
    "MAX_PENDING_BYTES",
    "MAX_PENDING_BYTES_TOTAL",
    "REPLAY_TIMEOUT_S",
    "InstanceFollower",
    "KvEventSink",
    "PendingBudget",
    "ReplayChannel",
]

REPLAY_TIMEOUT_S = 2.0
# Live batches buffered during one replay; past either bound the replay is given up (reset).
MAX_PENDING_BATCHES = 20_000
MAX_PENDING_BYTES = 64 << 20
# Bytes every follower of one subscriber holds together (buffered, or accepted and not yet applied).
MAX_PENDING_BYTES_TOTAL = 256 << 20
# Blocks (and events) applied between two yields to the event loop: about 3 ms of work (a block's
# own hash and its index entries: 2-3 us). The loop may wait for two slices: what runs and what is next.
APPLY_SLICE_BLOCKS: Final = 1024
# Decoding this many bytes (a batch scanned, an event's lists built; done in C) counts as one block.
BYTES_PER_BLOCK: Final = 256
# A skipped event counts as this many blocks (its decode fails through a few exceptions: ~5 us).
SKIPPED_EVENT_BLOCKS: Final = 4


class PendingBudget:
    """Bytes of KV batches held by the followers sharing it, bounded by ``limit``."""

    def __init__(self, limit: int = MAX_PENDING_BYTES_TOTAL) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int, *, force: bool = False) -> bool:
        """Hold ``size`` more bytes; False (nothing held) past the limit unless ``force``."""
        if not force and self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


class KvEventSink(Protocol):
    """Where the ordered events go (the KV index). Re-exported by ``routing.subscriber``."""

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None: ...  # in seq order

    def reset(self, instance_id: str) -> None: ...  # forget every block of this instance


class ReplayChannel(Protocol):
    """The DEALER to one publisher's replay ROUTER."""

    def request(self, start_seq: int) -> None:
        """Ask for every buffered batch from ``start_seq`` on (errors surface as the deadline)."""

    def cancel(self) -> None:
        """Forget the outstanding replay: its late replies must never be read (a new DEALER)."""


@dataclass(slots=True)
class _Work:
    """An accepted batch being applied: its encoded events, and how far it got."""

    seq: int
    size: int  # payload bytes, held in the budget until it is done
    events: list[msgspec.Raw]
    position: int = 0  # events decoded
    split: BlockStored | BlockRemoved | None = None  # a long event applied in pieces
    offset: int = 0  # blocks of ``split`` applied
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> events skipped, not yet counted
    detail: dict[str, str] = field(default_factory=dict)  # reason -> the first one's detail


@dataclass(slots=True)
class _Replay:
    start: int
    reason: str
    started: float
    deadline: float
    batches: int = 0
    applied: int = 0
    reset: bool = False
    truncated: bool = False


class InstanceFollower:
    """Orders one instance's batches into ``sink``; ``replay`` is None without a replay endpoint."""

    def __init__(
        self,
        instance_id: str,
        sink: KvEventSink,
        *,
        topic: bytes,
        replay: ReplayChannel | None,
        metrics: KvMetrics,
        clock: Callable[[], float],
        timeout_s: float = REPLAY_TIMEOUT_S,
        max_pending: int = MAX_PENDING_BATCHES,
        log: KvLog | None = None,
        budget: PendingBudget | None = None,
        slice_blocks: int | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.last: int | None = None
        self.live_high: int | None = None
        self.pending: deque[tuple[int, bytes]] = deque()
        self._pending_bytes = 0
        self._replay: _Replay | None = None
        self._sink = sink
        self._topic = topic
        self._channel = replay
        self._metrics = metrics
        self._clock = clock
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._log = log or KvLog(instance_id)
        self._budget = budget if budget is not None else PendingBudget()
        self._slice = slice_blocks
        self._credit = slice_blocks or 0  # work left in this slice (unused without slices)
        self._accepted: deque[tuple[int, bytes]] = deque()  # accepted, not yet decoded
        self._work: _Work | None = None

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @property
    def backlogged(self) -> bool:
        """Accepted batches wait to be applied (``settle``): read no more input meanwhile."""
        return self._work is not None or bool(self._accepted)

    def deadline(self) -> float | None:
        """When the outstanding replay times out (None: no replay outstanding)."""
        return self._replay.deadline if self._replay is not None else None

    def start(self) -> None:
        """Catch up first: replay everything the publisher still buffers (from seq 0)."""
        if self._channel is not None:
            self._start_replay(0, "catch_up")

    def close(self) -> None:
        """Stop following: an outstanding replay is abandoned (the owner resets the sink)."""
        if self._replay is not None:
            self._finish_replay("abandoned")
        self._clear_pending()
        self._drop_work()

    def refill(self) -> None:
        """A new slice of work may be done (before reading input)."""
        self._credit = self._slice or 0

    def settle(self) -> bool:
        """Apply the waiting batches, one slice; True while some still wait (yield, then call again).
        An outstanding replay's deadline is for the publisher's silence, not for this work."""
        self.refill()
        self._run()
        replay = self._replay
        if replay is not None:
            replay.deadline = max(replay.deadline, self._clock() + self._timeout_s)
        return self.backlogged

    # -- input ---------------------------------------------------------------------------------

    def on_live(self, frames: list[bytes]) -> None:
        """One message of the SUB socket."""
        try:
            topic, seq, payload = parse_live(frames)
        except KvEventDecodeError as exc:
            self._reject(exc.reason, exc.detail, "live")
            return
        if topic != self._topic:
            self._reject("other_topic", f"topic {topic[:64]!r}", "live")
            return
        if self.live_high is not None and seq <= self.live_high:
            self._restart(seq)
        self.live_high = seq
        if self._replay is not None:
            self._buffer(seq, payload)
        else:
            self._offer(seq, payload)

    def on_replay(self, frames: list[bytes]) -> None:
        """One reply of the replay ROUTER, as the DEALER received it."""
        replay = self._replay
        if replay is None:
            self._reject("unexpected_replay", f"{len(frames)} frames with no replay outstanding", "replay")
            return
        try:
            frame = parse_replay(frames)
        except KvEventDecodeError as exc:
            self._reject(exc.reason, exc.detail, "replay")
            self._give_up("replay_garbage")
            return
        replay.deadline = self._clock() + self._timeout_s  # it is answering: the deadline is for silence
        if frame.end:
            self._end_replay(replay)
            return
        replay.batches += 1
        seq, last = frame.seq, self.last
        if last is not None and seq <= last:
            self._metrics.duplicates.inc()
        elif last is None or seq == last + 1:
            replay.truncated = replay.truncated or (last is None and seq > replay.start)
            replay.applied += 1
            self._apply(seq, frame.payload)
        else:  # the publisher no longer buffers last + 1 (or skipped it): resync from here
            self._metrics.gaps.inc()
            self._log.gap(last + 1, seq, now=self._clock())
            replay.reset = True
            replay.applied += 1
            self._reset("replay_incomplete")
            self._apply(seq, frame.payload)

    def expire(self) -> None:
        """Time passes: a replay silent past its deadline is given up."""
        replay = self._replay
        if replay is not None and self._clock() >= replay.deadline:
            self._give_up("replay_timeout", outcome="timeout")

    # -- ordering ------------------------------------------------------------------------------

    def _offer(self, seq: int, payload: bytes) -> None:
        """A live batch with no replay outstanding."""
        last = self.last
        if last is None or seq == last + 1:
            self._apply(seq, payload)
            return
        if seq <= last:
            self._metrics.duplicates.inc()
            return
        self._metrics.gaps.inc()
        self._log.gap(last + 1, seq, now=self._clock())
        if self._channel is None:
            self._reset("gap_without_replay")
            self._apply(seq, payload)
            return
        self._start_replay(last + 1, "gap")
        self._buffer(seq, payload)

    def _buffer(self, seq: int, payload: bytes) -> None:
        size = len(payload)
        if (
            len(self.pending) >= self._max_pending
            or self._pending_bytes + size > MAX_PENDING_BYTES
            or not self._budget.take(size)
        ):
            self.pending.append((seq, payload))  # applied after the reset, with the rest
            self._pending_bytes += size
            self._budget.take(size, force=True)
            self._give_up("pending_overflow")
            return
        self.pending.append((seq, payload))
        self._pending_bytes += size

    def _start_replay(self, start: int, reason: str) -> None:
        assert self._channel is not None
        now = self._clock()
        self._replay = _Replay(start, reason, started=now, deadline=now + self._timeout_s)
        self._log.replay_started(start, reason, now=now)
        self._channel.request(start)

    def _end_replay(self, replay: _Replay) -> None:
        """The end marker: a gap that remains after a replay that brought nothing cannot be filled."""
        last = self.last
        newer = next((seq for seq, _ in self.pending if last is None or seq > last), None)
        if last is not None and newer is not None and newer > last + 1 and not replay.applied:
            replay.reset = True
            self._reset("replay_incomplete")
        self._finish_replay("reset" if replay.reset else "truncated" if replay.truncated else "filled")
        self._drain_pending()

    def _give_up(self, reason: str, *, outcome: str = "reset") -> None:
        """The replay cannot fill the gap: reset and resync from the buffered live batches."""
        self._finish_replay(outcome)
        self._reset(reason)
        self._drain_pending()

    def _finish_replay(self, outcome: str) -> None:
        replay = self._replay
        assert replay is not None
        self._replay = None
        if outcome not in ("filled", "truncated") and self._channel is not None:
            self._channel.cancel()
        now = self._clock()
        self._metrics.replays.labels(outcome=outcome).inc()
        self._log.replay_finished(
            outcome,
            replay.start,
            batches=replay.batches,
            last_seq=self.last,
            seconds=now - replay.started,
            now=now,
        )

    def _drain_pending(self) -> None:
        """Apply the buffered live batches; one of them may start another replay (the rest waits,
        unless that replay is given up meanwhile: then the rest applies)."""
        pending = self.pending
        self.pending = deque()
        self._pending_bytes = 0
        while pending:
            seq, payload = pending.popleft()
            self._budget.give(len(payload))  # taken again where it goes
            if self._replay is None:
                self._offer(seq, payload)
            else:
                self._buffer(seq, payload)

    def _restart(self, seq: int) -> None:
        """The live seq went back: a new publisher behind the same address; start over."""
        if self._replay is not None:
            self._finish_replay("abandoned")
        self._clear_pending()
        self._reset("publisher_restart")
        self.live_high = None
        if self._channel is not None:
            self._start_replay(0, "publisher_restart")

    def _clear_pending(self) -> None:
        self._budget.give(self._pending_bytes)
        self.pending.clear()
        self._pending_bytes = 0

    # -- the sink ------------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        """Accept a batch: it is applied now, or within the next slices after the ones before it."""
        self.last = seq
        self._budget.take(len(payload), force=True)
        self._accepted.append((seq, payload))
        self._run()

    def _run(self) -> None:
        """Apply waiting batches in order while the slice has room (always, without slices)."""
        while self._slice is None or self._credit > 0:
            work = self._work or self._open()
            if work is None:
                return
            self._step(work)
            if work.split is None and work.position == len(work.events):
                self._finish(work)

    def _open(self) -> _Work | None:
        """The next accepted batch (an unusable one is counted, its seq consumed), while the slice
        has room."""
        while self._accepted and (self._slice is None or self._credit > 0):
            seq, payload = self._accepted.popleft()
            self._credit -= 1 + len(payload) // BYTES_PER_BLOCK
            try:
                events = open_batch(payload).events
            except KvEventDecodeError as exc:
                self._budget.give(len(payload))
                self._reject(exc.reason, f"seq {seq}: {exc.detail}", "batch")
                continue
            self._work = _Work(seq, len(payload), events)
            return self._work
        return None

    def _step(self, work: _Work) -> None:
        """Decode and apply ``work``'s events while the slice has room, in one sink call."""
        ready: list[KVEvent] = []
        unlimited = self._slice is None
        while unlimited or self._credit > 0:
            if work.split is None:
                if work.position == len(work.events):
                    break
                event = self._decode(work)
                if event is None:
                    continue
                self._count(event)
                if isinstance(event, AllBlocksCleared) or len(event.block_hashes) < self._credit or unlimited:
                    self._credit -= 1 if isinstance(event, AllBlocksCleared) else 1 + len(event.block_hashes)
                    ready.append(event)
                    continue
                work.split, work.offset = event, 0
            taken = min(len(work.split.block_hashes) - work.offset, max(1, self._credit))
            ready.append(_piece(work.split, work.offset, taken))
            self._credit -= taken
            work.offset += taken
            if work.offset >= len(work.split.block_hashes):
                work.split = None
        self._flush_skipped(work)
        if ready:
            self._sink_apply(ready)

    def _decode(self, work: _Work) -> KVEvent | None:
        raw = work.events[work.position]
        work.position += 1
        self._credit -= len(raw) // BYTES_PER_BLOCK  # a long event is decoded whole: its slice ends
        try:
            return decode_event(raw)
        except KvEventDecodeError as exc:  # counted, not kept: one count per reason, one detail
            self._credit -= SKIPPED_EVENT_BLOCKS
            work.skipped[exc.reason] = work.skipped.get(exc.reason, 0) + 1
            work.detail.setdefault(exc.reason, exc.detail)
            return None

    def _flush_skipped(self, work: _Work) -> None:
        for reason, count in work.skipped.items():
            self._metrics.rejected.labels(reason=reason).inc(count)
            detail = f"seq {work.seq}: {work.detail[reason]} ({count} event(s) like it)"
            self._log.rejected(reason, detail, source="event", now=self._clock())
        work.skipped.clear()
        work.detail.clear()

    def _finish(self, work: _Work) -> None:
        self._work = None
        self._budget.give(work.size)

    def _drop_work(self) -> None:
        """Forget what waits (before a reset: applying it first would change nothing)."""
        if self._work is not None:
            self._finish(self._work)
        for _, payload in self._accepted:
            self._budget.give(len(payload))
        self._accepted.clear()

    def _sink_apply(self, events: list[KVEvent]) -> None:
        try:
            self._sink.apply(self.instance_id, events)
        except Exception as exc:  # the index's bug must not stop this instance's stream
            self._metrics.rejected.labels(reason="sink_error").inc()
            self._log.sink_failed("apply", exc, now=self._clock())

    def _count(self, event: KVEvent) -> None:
        metrics = self._metrics
        if isinstance(event, BlockStored):
            metrics.stored_events.inc()
            metrics.stored_blocks.inc(len(event.block_hashes))
        elif isinstance(event, BlockRemoved):
            metrics.removed_events.inc()
            metrics.removed_blocks.inc(len(event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            metrics.cleared_events.inc()

    def _reset(self, reason: str) -> None:
        now = self._clock()
        self._metrics.resets.labels(reason=reason).inc()
        self._log.reset(reason, last_seq=self.last, now=now)
        self.last = None
        self._drop_work()
        try:
            self._sink.reset(self.instance_id)
        except Exception as exc:
            self._metrics.rejected.labels(reason="sink_error").inc()
            self._log.sink_failed("reset", exc, now=now)

    def _reject(self, reason: str, detail: str, source: str) -> None:
        self._metrics.rejected.labels(reason=reason).inc()
        self._log.rejected(reason, detail, source=source, now=self._clock())


def _piece(event: BlockStored | BlockRemoved, offset: int, count: int) -> KVEvent:
    """Blocks ``offset`` to ``offset + count`` of a long event, as an event of their own: a stored
    piece chains to the block before it, so the pieces in order apply as the whole would."""
    end = offset + count
    if isinstance(event, BlockRemoved):
        return msgspec.structs.replace(event, block_hashes=event.block_hashes[offset:end])
    size = event.block_size
    return msgspec.structs.replace(
        event,
        block_hashes=event.block_hashes[offset:end],
        parent_block_hash=event.parent_block_hash if offset == 0 else event.block_hashes[offset - 1],
        token_ids=event.token_ids[offset * size : end * size],
        extra_keys=None if event.extra_keys is None else event.extra_keys[offset:end],
    )
