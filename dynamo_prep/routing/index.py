"""Which instance holds which prefix: every instance's cached blocks, keyed by the frontend's own hashes.

A block's own hash stands for its whole prefix (it is chained to its parent's), so one flat dict
``own hash -> instances holding it`` is a radix tree of prefixes with every node addressed
directly: walking a request's hashes in order walks down the tree, and no node needs links.
Holders are a bit mask (one bit per instance), so a step of ``match`` is one dict lookup and one
``&`` whatever the number of instances.

Engine hashes are opaque ids, meaningful only inside their instance: each instance has its own
map ``engine hash -> own hash`` (int and bytes hashes both work) for parent links and removals. An
event that cannot be placed (its parent is unknown to that instance, the wrong block size, a value
that cannot be hashed) is counted, logged rate-limited and skipped; it never touches another
instance's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from dynamo_prep.discovery.eventlog import RateLimiter
from dynamo_prep.protocol.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from dynamo_prep.routing.hashing import stored_block_hashes

__all__ = ["IndexCounters", "KvIndex"]

log = structlog.get_logger("dynamo_prep.routing")


@dataclass(slots=True)
class IndexCounters:
    """What the index applied and what it refused, since it was created (for metrics).

    ``unknown_parent_blocks``: blocks of stored events whose parent the instance does not hold
    (the whole event is skipped); ``unknown_removed_blocks``: removals of blocks the instance does
    not hold; ``invalid_events``: events with another block size, token ids that are not whole
    blocks, or values that cannot be hashed; ``cleared``: ``AllBlocksCleared`` events; ``resets``:
    ``reset`` calls (gap, expiry, withdraw).
    """

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    resets: int = 0
    unknown_parent_blocks: int = 0
    unknown_removed_blocks: int = 0
    invalid_events: int = 0


@dataclass(slots=True)
class _Holder:
    """One instance: its bit, and its blocks by engine hash."""

    bit: int
    own_of: dict[BlockHash, int] = field(default_factory=dict)
    # own hash -> how many of the instance's engine hashes stand for it (usually 1)
    refs: dict[int, int] = field(default_factory=dict)


class KvIndex:
    """The KV-event sink of one model (one block size): applies events, answers prefix matches.

    Not thread-safe: one event loop applies events and matches requests.
    """

    def __init__(self, block_size: int, *, limiter: RateLimiter | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.counters = IndexCounters()
        self._holders: dict[int, int] = {}  # own hash -> bit mask of the instances holding it
        self._instances: dict[str, _Holder] = {}
        self._slots: list[str | None] = []  # bit index -> instance id
        self._limiter = limiter or RateLimiter()

    # -- KvEventSink ---------------------------------------------------------------------------

    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        """Apply one instance's events in order (they come in seq order from its publisher)."""
        holder = self._instances.get(instance_id) or self._add(instance_id)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(instance_id, holder, event)
            elif isinstance(event, BlockRemoved):
                self._remove(instance_id, holder, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear(holder)
                self.counters.cleared += 1

    def reset(self, instance_id: str) -> None:
        """Forget every block of ``instance_id`` (and its bit, which a later instance may reuse)."""
        holder = self._instances.pop(instance_id, None)
        self.counters.resets += 1
        if holder is None:
            return
        self._clear(holder)
        self._slots[holder.bit.bit_length() - 1] = None

    # -- queries -------------------------------------------------------------------------------

    def match(self, own_hashes: Iterable[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of ``own_hashes`` it holds (instances with none
        are left out). Stops at the first block no instance holds, so a lazy iterable is only
        consumed that far."""
        holders = self._holders
        found: dict[str, int] = {}
        alive = -1  # every bit: before the first block, anyone may match
        depth = 0
        for own in own_hashes:
            mask = holders.get(own, 0) & alive
            if mask != alive:
                if depth:
                    self._credit(alive & ~mask, depth, found)
                if not mask:
                    return found
                alive = mask
            depth += 1
        if depth:
            self._credit(alive, depth, found)
        return found

    def blocks_held(self, instance_id: str) -> int:
        """Distinct blocks (own hashes) the instance holds."""
        holder = self._instances.get(instance_id)
        return 0 if holder is None else len(holder.refs)

    def instances(self) -> list[str]:
        """Instances that sent events since they were created or last reset."""
        return list(self._instances)

    def __len__(self) -> int:
        """Distinct blocks held by any instance."""
        return len(self._holders)

    # -- internals -----------------------------------------------------------------------------

    def _add(self, instance_id: str) -> _Holder:
        try:
            slot = self._slots.index(None)
        except ValueError:
            slot = len(self._slots)
            self._slots.append(None)
        self._slots[slot] = instance_id
        holder = self._instances[instance_id] = _Holder(bit=1 << slot)
        return holder

    def _credit(self, mask: int, depth: int, found: dict[str, int]) -> None:
        slots = self._slots
        while mask:
            low = mask & -mask
            instance_id = slots[low.bit_length() - 1]
            if instance_id is not None:
                found[instance_id] = depth
            mask ^= low

    def _store(self, instance_id: str, holder: _Holder, event: BlockStored) -> None:
        blocks = len(event.block_hashes)
        parent = event.parent_block_hash
        try:
            parent_own = None if parent is None else holder.own_of.get(parent)
            if parent is not None and parent_own is None:
                self.counters.unknown_parent_blocks += blocks
                self._refused(instance_id, "unknown_parent", blocks)
                return
            if event.block_size != self.block_size or len(event.token_ids) != blocks * self.block_size:
                raise ValueError("block size")
            owns = stored_block_hashes(parent_own, event)
            for engine, own in zip(event.block_hashes, owns, strict=True):
                self._link(holder, engine, own)
        except (TypeError, ValueError, RecursionError):
            self.counters.invalid_events += 1
            self._refused(instance_id, "invalid", blocks)
            return
        self.counters.stored_blocks += blocks

    def _link(self, holder: _Holder, engine: BlockHash, own: int) -> None:
        previous = holder.own_of.get(engine)
        if previous == own:
            return
        if previous is not None:  # the engine reused a hash for other content: the old block is gone
            self._unlink(holder, previous)
        holder.own_of[engine] = own
        count = holder.refs.get(own, 0)
        holder.refs[own] = count + 1
        if not count:
            self._holders[own] = self._holders.get(own, 0) | holder.bit

    def _remove(self, instance_id: str, holder: _Holder, event: BlockRemoved) -> None:
        unknown = 0
        try:
            for engine in event.block_hashes:
                own = holder.own_of.pop(engine, None)
                if own is None:
                    unknown += 1
                else:
                    self._unlink(holder, own)
                    self.counters.removed_blocks += 1
        except TypeError:
            self.counters.invalid_events += 1
            self._refused(instance_id, "invalid", len(event.block_hashes))
        if unknown:
            self.counters.unknown_removed_blocks += unknown
            self._refused(instance_id, "unknown_block", unknown)

    def _unlink(self, holder: _Holder, own: int) -> None:
        count = holder.refs[own] - 1
        if count:
            holder.refs[own] = count
            return
        del holder.refs[own]
        mask = self._holders[own] & ~holder.bit
        if mask:
            self._holders[own] = mask
        else:
            del self._holders[own]

    def _clear(self, holder: _Holder) -> None:
        holders, keep = self._holders, ~holder.bit
        for own in holder.refs:
            mask = holders[own] & keep
            if mask:
                holders[own] = mask
            else:
                del holders[own]
        holder.refs.clear()
        holder.own_of.clear()

    def _refused(self, instance_id: str, reason: str, blocks: int) -> None:
        suppressed = self._limiter.allow(f"{reason}:{instance_id}", time.monotonic())
        if suppressed is not None:
            log.warning(
                "kv_event_refused",
                reason=reason,
                instance_id=instance_id,
                blocks=blocks,
                suppressed=suppressed,
            )
