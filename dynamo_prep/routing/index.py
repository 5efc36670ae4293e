"""Which instance holds which prefix: every instance's cached blocks, keyed by the frontend's own hashes.

A block's own hash stands for its whole prefix (it is chained to its parent's), so one flat dict
``own hash -> instances holding it`` is a radix tree of prefixes with every node addressed
directly: no links are needed to walk down it. Holders are a bit mask (one bit per instance).

Invariant: what an instance holds is closed under ancestors (it holds every block before each
block it holds). Engines keep it themselves (vLLM frees a request's blocks tail first and evicts
least recently used first; SGLang evicts radix-tree leaves), and the index enforces it: a store
whose parent the instance does not hold is refused, and a block removed while its descendants
are still held takes them along (counted as ``orphaned_blocks``). So along a request's hashes
each instance's holding is a run from the first block, and ``match`` finds where each run ends by
bisection: a few dozen dict lookups instead of one per block (lookups in a table of 400k blocks
miss the CPU cache; a walk over an 8k-token prompt would cost more than the whole budget).

Engine hashes are opaque ids, meaningful only inside their instance: each instance has its own
map ``engine hash -> own hash`` (int and bytes hashes both work) for parent links and removals. An
event that cannot be placed is counted, logged rate-limited and skipped; it never touches another
instance's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from dynamo_prep.routing.hashing import ROOT_HASH, stored_block_hashes

__all__ = ["IndexCounters", "KvIndex"]

log = structlog.get_logger("dynamo_prep.routing")


@dataclass(slots=True)
class IndexCounters:
    """What the index applied and what it refused, since it was created (for metrics).

    ``unknown_parent_blocks``: blocks of stored events whose parent the instance does not hold
    (the whole event is skipped); ``unknown_removed_blocks``: removals of blocks the instance does
    not hold; ``orphaned_blocks``: blocks dropped because an ancestor was removed before them;
    ``invalid_events``: events with another block size, token ids that are not whole blocks, or
    values that cannot be hashed; ``cleared``: ``AllBlocksCleared`` events; ``resets``: ``reset``
    calls (gap, expiry, withdraw).
    """

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    resets: int = 0
    unknown_parent_blocks: int = 0
    unknown_removed_blocks: int = 0
    orphaned_blocks: int = 0
    invalid_events: int = 0


@dataclass(slots=True)
class _Holder:
    """One instance: its bit, its blocks by engine hash, and the tree of the blocks it holds."""

    instance_id: str
    bit: int
    own_of: dict[BlockHash, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)  # own hash -> engine hashes standing for it
    parent: dict[int, int] = field(default_factory=dict)  # own hash -> its parent's (or ROOT_HASH)
    children: dict[int, int] = field(default_factory=dict)  # own hash -> children held


class _Held(Mapping[str, int]):
    """Blocks held per instance, read on demand (the policy only looks on a tie)."""

    def __init__(self, instances: dict[str, _Holder]) -> None:
        self._instances = instances

    def __getitem__(self, instance_id: str) -> int:
        return len(self._instances[instance_id].refs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._instances)

    def __len__(self) -> int:
        return len(self._instances)


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

    def match(self, own_hashes: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of ``own_hashes`` (a request's hashes, in order)
        it holds; instances holding none are left out.

        One lookup when nobody holds the first block; else about log2(blocks) lookups per
        instance whose run ends inside the request.
        """
        count = len(own_hashes)
        get = self._holders.get
        first = get(own_hashes[0], 0) if count else 0
        if not first:
            return {}
        found: dict[str, int] = {}
        last = get(own_hashes[-1], 0) & first
        self._credit(last, count, found)
        pending = [(0, first, count - 1, last)] if first != last else []
        while pending:
            # every instance in low_mask holds blocks 0..low, in high_mask 0..high (low < high)
            low, low_mask, high, high_mask = pending.pop()
            if high - low == 1:
                self._credit(low_mask & ~high_mask, high, found)
                continue
            mid = (low + high) // 2
            mid_mask = get(own_hashes[mid], 0) & low_mask | high_mask
            if mid_mask != low_mask:
                pending.append((low, low_mask, mid, mid_mask))
            if mid_mask != high_mask:
                pending.append((mid, mid_mask, high, high_mask))
        return found

    def blocks_held(self, instance_id: str) -> int:
        """Distinct blocks (own hashes) the instance holds."""
        holder = self._instances.get(instance_id)
        return 0 if holder is None else len(holder.refs)

    def held(self) -> Mapping[str, int]:
        """``blocks_held`` of every instance as a live read-only mapping (computed on access)."""
        return _Held(self._instances)

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
        holder = self._instances[instance_id] = _Holder(instance_id, 1 << slot)
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
        try:
            known = None if event.parent_block_hash is None else holder.own_of.get(event.parent_block_hash)
            if event.parent_block_hash is not None and known is None:
                self.counters.unknown_parent_blocks += blocks
                self._refused(instance_id, "unknown_parent", blocks)
                return
            if event.block_size != self.block_size or len(event.token_ids) != blocks * self.block_size:
                raise ValueError("block size")
            parent = ROOT_HASH if known is None else known
            placed = self._place(holder, event.block_hashes, stored_block_hashes(parent, event), parent)
        except (TypeError, ValueError, RecursionError):
            self.counters.invalid_events += 1
            self._refused(instance_id, "invalid", blocks)
            return
        self.counters.stored_blocks += placed
        if placed < blocks:
            self.counters.unknown_parent_blocks += blocks - placed
            self._refused(instance_id, "unknown_parent", blocks - placed)

    def _place(self, holder: _Holder, engines: list[BlockHash], owns: list[int], parent: int) -> int:
        """Link each engine hash to its own hash, chained from ``parent``; returns how many were
        placed (fewer only if relinking a reused engine hash dropped the parent). The hot path of
        ingestion: a new engine hash for a block the instance did not hold is handled inline."""
        own_of, refs, holders, bit = holder.own_of, holder.refs, self._holders, holder.bit
        parents, children = holder.parent, holder.children
        for placed, (engine, own) in enumerate(zip(engines, owns, strict=True)):
            if engine in own_of or own in refs:
                if not self._link(holder, engine, own, parent):
                    return placed
            else:
                own_of[engine] = own
                refs[own] = 1
                holders[own] = holders.get(own, 0) | bit
                parents[own] = parent
                children[parent] = children.get(parent, 0) + 1
            parent = own
        return len(owns)

    def _link(self, holder: _Holder, engine: BlockHash, own: int, parent: int) -> bool:
        """``engine`` now stands for ``own`` (child of ``parent``); False if the parent is gone."""
        previous = holder.own_of.get(engine)
        if previous == own:
            return True
        if previous is not None:  # the engine reused a hash for other content: the old block is gone
            del holder.own_of[engine]
            self._unlink(holder, previous)
            if parent != ROOT_HASH and parent not in holder.refs:
                return False
        holder.own_of[engine] = own
        count = holder.refs.get(own, 0)
        holder.refs[own] = count + 1
        if not count:
            self._holders[own] = self._holders.get(own, 0) | holder.bit
            holder.parent[own] = parent
            holder.children[parent] = holder.children.get(parent, 0) + 1
        return True

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
        """One engine hash for ``own`` is gone; the block goes when the last one does."""
        count = holder.refs[own] - 1
        if count:
            holder.refs[own] = count
            return
        if holder.children.get(own):
            self._orphan_descendants(holder, own)
        self._drop(holder, own)

    def _drop(self, holder: _Holder, own: int) -> None:
        del holder.refs[own]
        mask = self._holders[own] & ~holder.bit
        if mask:
            self._holders[own] = mask
        else:
            del self._holders[own]
        parent = holder.parent.pop(own)
        left = holder.children[parent] - 1
        if left:
            holder.children[parent] = left
        else:
            del holder.children[parent]

    def _orphan_descendants(self, holder: _Holder, own: int) -> None:
        """``own`` leaves before its descendants (no engine we know does this): drop them too, so
        the instance's blocks stay closed under ancestors. Walks all its blocks; rare."""
        below: dict[int, list[int]] = {}
        for child, parent in holder.parent.items():
            below.setdefault(parent, []).append(child)
        doomed: list[int] = []
        frontier = list(below.get(own, ()))
        while frontier:
            block = frontier.pop()
            doomed.append(block)
            frontier.extend(below.get(block, ()))
        gone = set(doomed)
        for engine in [engine for engine, value in holder.own_of.items() if value in gone]:
            del holder.own_of[engine]
        for block in reversed(doomed):  # deepest first: a block leaves after its children
            self._drop(holder, block)
        self.counters.orphaned_blocks += len(doomed)
        self._warn("kv_blocks_orphaned", holder.instance_id, "removed_before_descendants", len(doomed))

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
        holder.parent.clear()
        holder.children.clear()

    def _refused(self, instance_id: str, reason: str, blocks: int) -> None:
        self._warn("kv_event_refused", instance_id, reason, blocks)

    def _warn(self, event: str, instance_id: str, reason: str, blocks: int) -> None:
        """One line per (reason, instance) per interval at most: a peer decides how often."""
        suppressed = self._limiter.allow(f"{reason}:{instance_id}", time.monotonic())
        if suppressed is not None:
            log.warning(
                event,
                reason=reason,
                instance_id=instance_id,
                blocks=blocks,
                suppressed=suppressed,
            )
