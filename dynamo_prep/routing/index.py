"""Which instance holds which prefix: every instance's cached blocks, keyed by the frontend's own hashes.

A block's own hash stands for its whole prefix (it is chained to its parent's), so one flat dict
``own hash -> instances holding it`` is a radix tree of prefixes with every node addressed
directly: no links are needed to walk down it. Holders are a bit mask (one bit per instance).

Invariant: what an instance holds is closed under ancestors (it holds every block before each
block it holds). Engines keep it themselves (vLLM frees a request's blocks tail first and evicts
least recently used first; SGLang evicts radix-tree leaves), and the index enforces it: a store
whose parent the instance does not hold is refused, and a block removed while its descendants
are still held takes them along (counted as ``orphaned_blocks``; each block knows its children, so
this costs the blocks dropped, never a scan of the instance, and at most ``DROP_PER_APPLY`` of them
per ``apply`` call: leaves first, the removed block last, the rest in the next calls). So along a
request's hashes
each instance's holding is a run from the first block, and ``match`` finds where each run ends by
bisection: a few dozen dict lookups instead of one per block (lookups in a table of 400k blocks
miss the CPU cache; a walk over an 8k-token prompt would cost more than the whole budget).

Engine hashes are opaque ids, meaningful only inside their instance: each instance has its own
map ``engine hash -> own hash`` (int and bytes hashes both work) for parent links and removals. An
event that cannot be placed is counted, logged rate-limited and skipped; it never touches another
instance's blocks. Every event costs O(its own size) (plus the blocks it drops), and an instance
holds at most its engine's own capacity (``set_capacity``, from its card) and never more than
``MAX_INSTANCE_BLOCKS``: stores past that are refused (``over_capacity``).

Beside what the events say, ``predict`` counts a routed request's blocks as present on its instance
until the events speak of them (``routing.predicted``): ``match`` reports both.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import structlog

from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from dynamo_prep.routing.hashing import ROOT_HASH, stored_block_hashes
from dynamo_prep.routing.predicted import PredictedBlocks

__all__ = ["MAX_INSTANCE_BLOCKS", "IndexCounters", "KvIndex"]

# Blocks one instance may hold whatever its card says (about 400 bytes each in the index): above
# any engine we know at the block sizes they use, and a bound on what one hostile card can claim.
MAX_INSTANCE_BLOCKS: Final = 1 << 21
# Descendants of removed blocks dropped per ``apply`` call (a few ms); the rest wait for the next.
# Also the entries of reset instances taken out of the table per ``apply`` or ``reset``.
DROP_PER_APPLY: Final = 2048
# A table's bucket is sized for this many entries: rehashing one costs well under a millisecond.
BUCKET_ENTRIES: Final = 1 << 14
# Buckets of the table every instance's blocks are in (room for 16M distinct blocks at that size).
HOLDERS_ENTRIES: Final = 1 << 24
# Slots a table's buckets share (at least 32 per bucket): the granularity of their shares.
ROUTE_SLOTS: Final = 1 << 12
_MIX: Final = secrets.randbits(64) | 1  # odd: a bijection of the 64-bit hashes
_MASK64: Final = (1 << 64) - 1

log = structlog.get_logger("dynamo_prep.routing")

_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass(slots=True)
class IndexCounters:
    """What the index applied and what it refused, since it was created (for metrics).

    ``unknown_parent_blocks``: blocks of stored events whose parent the instance does not hold
    (the whole event is skipped); ``unknown_removed_blocks``: removals of blocks the instance does
    not hold; ``orphaned_blocks``: blocks dropped because an ancestor was removed before them;
    ``over_capacity_blocks``: blocks refused because the instance held its bound already;
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
    over_capacity_blocks: int = 0
    invalid_events: int = 0


class _Table(Generic[_K, _V]):
    """A dict split into buckets sized for about ``BUCKET_ENTRIES`` each, so that no insert rehashes
    more than one of them (a plain dict of 1.4M entries rehashes them all in one insert: 60 ms).

    A key's hash times a secret odd multiplier picks one of ``ROUTE_SLOTS`` slots (keys a peer
    chooses do not pile up), and a slot one bucket. Bucket shares grow geometrically by a factor of
    two from the first bucket to the last: buckets that filled evenly would reach their rehash
    sizes together (in one slice of work, whatever the key distribution), these reach them one
    after another across each doubling (docs/kv-events.md, "Costs and bounds")."""

    __slots__ = ("buckets", "route", "shift")

    def __init__(self, entries: int, *, made: bool = False) -> None:
        """Buckets for ``entries``, all ``made`` now or each on first use (an instance that holds
        little costs little)."""
        count = max(-(-entries // BUCKET_ENTRIES), 1)
        self.buckets: list[dict[_K, _V] | None] = [{} for _ in range(count)] if made else [None] * count
        self.route = _route(count)
        self.shift = 64 - (len(self.route).bit_length() - 1)  # 64 with one slot: always slot 0

    def of(self, key: _K) -> dict[_K, _V]:
        """The bucket ``key`` belongs in."""
        return self.at(_mixed(key))

    def at(self, mixed: int) -> dict[_K, _V]:
        """The bucket of a key whose ``_mixed`` hash is ``mixed``."""
        index = self.route[mixed >> self.shift]
        return self.buckets[index] or self.made(index)

    def made(self, index: int) -> dict[_K, _V]:
        """Bucket ``index``, made if it was not (or the empty one it is)."""
        bucket = self.buckets[index]
        if bucket is None:
            bucket = self.buckets[index] = {}
        return bucket


def _mixed(key: object) -> int:
    """The hash tables pick a key's bucket by (a secret odd multiple of it, on 64 bits)."""
    return (hash(key) * _MIX) & _MASK64


@functools.cache
def _route(count: int) -> tuple[int, ...]:
    """Slot -> bucket for ``count`` buckets, bucket ``i``'s share proportional to ``2 ** (i / count)``."""
    if count == 1:
        return (0,)
    slots = max(ROUTE_SLOTS, 1 << (count * 32 - 1).bit_length())
    weights = [2 ** (i / count) for i in range(count)]
    total = sum(weights)
    ends = list(itertools.accumulate(round(slots * weight / total) for weight in weights))
    ends[-1] = slots
    return tuple(bisect.bisect_right(ends, slot) for slot in range(slots))


@dataclass(slots=True)
class _Holder:
    """One instance: its bit, its bound, its blocks by engine hash, and the tree of the blocks it
    holds. A value that is usually single is stored as is, and as a set only when there are several.
    ``engine_hashes`` and ``blocks`` count the entries of ``own_of`` and ``engines``."""

    instance_id: str
    bit: int
    capacity: int
    own_of: _Table[BlockHash, int]  # engine hash -> own hash
    engines: _Table[int, BlockHash | set[BlockHash]]  # own -> engine hash(es)
    parent: _Table[int, int]  # own hash -> its parent's (or ROOT_HASH)
    children: _Table[int, int | set[int]]  # own hash -> child(ren) held
    engine_hashes: int = 0
    blocks: int = 0
    doomed: list[int] = field(default_factory=list)  # removed blocks whose descendants are being dropped

    def holds(self, own: int) -> bool:
        return own in self.engines.of(own)

    @classmethod
    def new(cls, instance_id: str, bit: int, capacity: int) -> _Holder:
        return cls(
            instance_id, bit, capacity, _Table(capacity), _Table(capacity), _Table(capacity), _Table(capacity)
        )


def _add(table: dict[_K, _V | set[_V]], key: _K, value: _V) -> None:
    """One more ``value`` under ``key``."""
    current = table.get(key)
    if current is None:
        table[key] = value
    elif isinstance(current, set):
        current.add(value)
    else:
        table[key] = {current, value}


def _discard(table: dict[_K, _V | set[_V]], key: _K, value: _V) -> bool:
    """One ``value`` less under ``key``; True when none is left (the key is gone)."""
    current = table[key]
    if isinstance(current, set):
        current.discard(value)
        if len(current) > 1:
            return False
        if current:
            table[key] = current.pop()
            return False
    del table[key]
    return True


def _values(value: _V | set[_V]) -> list[_V]:
    return list(value) if isinstance(value, set) else [value]


class _Held(Mapping[str, int]):
    """Blocks held per instance, read on demand (the policy only looks on a tie)."""

    def __init__(self, instances: dict[str, _Holder]) -> None:
        self._instances = instances

    def __getitem__(self, instance_id: str) -> int:
        return self._instances[instance_id].blocks

    def get(self, instance_id: str, default: int = 0) -> int:  # type: ignore[override]
        """Without ``Mapping.get``'s KeyError for every instance that holds nothing."""
        holder = self._instances.get(instance_id)
        return default if holder is None else holder.blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._instances)

    def __len__(self) -> int:
        return len(self._instances)


class KvIndex:
    """The KV-event sink of one model (one block size): applies events, answers prefix matches.

    Not thread-safe: one event loop applies events and matches requests. ``on_refused(reason,
    blocks)`` is told of every refusal (the metrics). ``predict_ttl_s``: how long predicted blocks
    outlive their request's first token (0: no predictions); ``clock`` their time.
    """

    def __init__(
        self,
        block_size: int,
        *,
        limiter: RateLimiter | None = None,
        on_refused: Callable[[str, int], None] | None = None,
        predict_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.counters = IndexCounters()
        # own hash -> bit mask of the instances holding it
        self._holders: _Table[int, int] = _Table(HOLDERS_ENTRIES, made=True)
        self._distinct = 0  # entries of _holders
        self._instances: dict[str, _Holder] = {}
        self._capacity: dict[str, int] = {}  # instance id -> its bound, when its card says one
        self._slots: list[str | None] = []  # bit index -> instance id
        # reset or cleared: their bits leave _holders a slice at a time
        self._retired: deque[_Holder] = deque()
        self._retiring = 0  # their bits, not given to another instance until then
        self._limiter = limiter or RateLimiter()
        self._on_refused = on_refused
        self.predicted = PredictedBlocks(predict_ttl_s, clock=clock)

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
                self._retire(holder)
                holder = self._add(instance_id)
                self.counters.cleared += 1
        if holder.doomed:
            self._drop_doomed(holder, DROP_PER_APPLY)
        self._tidy(DROP_PER_APPLY)

    def reset(self, instance_id: str) -> None:
        """Forget every block of ``instance_id``: at once for matches, its entries a slice at a time
        (each later ``apply`` or ``reset`` takes one); its bit is free for a later instance then."""
        holder = self._instances.pop(instance_id, None)
        self.counters.resets += 1
        self.predicted.clear(instance_id)
        if holder is not None:
            self._retire(holder)
        self._tidy(DROP_PER_APPLY)

    # -- instances -----------------------------------------------------------------------------

    def set_capacity(self, instance_id: str, blocks: int | None) -> None:
        """The most blocks ``instance_id`` may hold: its engine's capacity (None or < 1: unknown),
        at most ``MAX_INSTANCE_BLOCKS``. Kept across resets, until ``forget``."""
        if blocks is None or blocks < 1:
            self._capacity.pop(instance_id, None)
        else:
            self._capacity[instance_id] = min(blocks, MAX_INSTANCE_BLOCKS)
        holder = self._instances.get(instance_id)
        if holder is not None:
            holder.capacity = self.capacity(instance_id)

    def capacity(self, instance_id: str) -> int:
        """The bound on the blocks ``instance_id`` may hold."""
        return self._capacity.get(instance_id, MAX_INSTANCE_BLOCKS)

    def forget(self, instance_id: str) -> None:
        """An instance that left: its blocks (as ``reset``, if it holds any) and its capacity."""
        self._capacity.pop(instance_id, None)
        self.predicted.clear(instance_id)
        if instance_id in self._instances:
            self.reset(instance_id)

    # -- queries -------------------------------------------------------------------------------

    def match(self, own_hashes: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of ``own_hashes`` (a request's hashes, in order)
        it holds or is predicted to hold; instances holding none are left out."""
        found = self.match_cached(own_hashes)
        if self.predicted:
            self.predicted.extend(own_hashes, found)
        return found

    def match_cached(self, own_hashes: Sequence[int]) -> dict[str, int]:
        """``match`` by the events alone.

        One lookup when nobody holds the first block; else about log2(blocks) lookups per
        instance whose run ends inside the request. Bits of retired instances may still be set:
        they are credited to nobody.
        """
        count = len(own_hashes)
        buckets, route, shift = self._holders.buckets, self._holders.route, self._holders.shift

        def holders(own: int) -> int:  # _Table.of inlined: its buckets are all made
            return buckets[route[_mixed(own) >> shift]].get(own, 0)  # type: ignore[union-attr]

        first = holders(own_hashes[0]) if count else 0
        if not first:
            return {}
        found: dict[str, int] = {}
        last = holders(own_hashes[-1]) & first
        self._credit(last, count, found)
        pending = [(0, first, count - 1, last)] if first != last else []
        while pending:
            # every instance in low_mask holds blocks 0..low, in high_mask 0..high (low < high)
            low, low_mask, high, high_mask = pending.pop()
            if high - low == 1:
                self._credit(low_mask & ~high_mask, high, found)
                continue
            mid = (low + high) // 2
            mid_mask = holders(own_hashes[mid]) & low_mask | high_mask
            if mid_mask != low_mask:
                pending.append((low, low_mask, mid, mid_mask))
            if mid_mask != high_mask:
                pending.append((mid, mid_mask, high, high_mask))
        return found

    def predict(self, instance_id: str, own_hashes: Sequence[int]) -> Sequence[int]:
        """A request of ``own_hashes`` was routed to ``instance_id``: the blocks past what its events
        say it holds count as held there until ``unpredict`` plus the time-to-live (at most its
        capacity's worth). Returns the hashes predicted, for ``unpredict``."""
        holder = self._instances.get(instance_id)
        cached = 0 if holder is None else _run(own_hashes, holder.holds)
        return self.predicted.pin(instance_id, own_hashes[cached:], self.capacity(instance_id))

    def unpredict(self, instance_id: str, predicted: Sequence[int]) -> None:
        """The request that predicted these blocks had its first token or ended: they live the
        time-to-live more, unless the events speak of them first."""
        self.predicted.unpin(instance_id, predicted)

    def blocks_held(self, instance_id: str) -> int:
        """Distinct blocks (own hashes) the instance holds."""
        holder = self._instances.get(instance_id)
        return 0 if holder is None else holder.blocks

    def held(self) -> Mapping[str, int]:
        """``blocks_held`` of every instance as a live read-only mapping (computed on access)."""
        return _Held(self._instances)

    def instances(self) -> list[str]:
        """Instances that sent events since they were created or last reset."""
        return list(self._instances)

    def __len__(self) -> int:
        """Distinct blocks held by any instance (retired ones' included until they are tidied)."""
        return self._distinct

    # -- internals -----------------------------------------------------------------------------

    def _add(self, instance_id: str) -> _Holder:
        slot = next(
            (n for n, owner in enumerate(self._slots) if owner is None and not self._retiring >> n & 1),
            len(self._slots),
        )
        if slot == len(self._slots):
            self._slots.append(None)
        self._slots[slot] = instance_id
        holder = _Holder.new(instance_id, 1 << slot, self.capacity(instance_id))
        self._instances[instance_id] = holder
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
            parent_hash = event.parent_block_hash
            known = None if parent_hash is None else holder.own_of.of(parent_hash).get(parent_hash)
            if parent_hash is not None and known is None:
                self.counters.unknown_parent_blocks += blocks
                self._refused(instance_id, "unknown_parent", blocks)
                return
            if holder.engine_hashes >= holder.capacity:  # refused before its hashes are computed
                placed, full = 0, True
            else:
                if event.block_size != self.block_size or len(event.token_ids) != blocks * self.block_size:
                    raise ValueError("block size")
                parent = ROOT_HASH if known is None else known
                owns = stored_block_hashes(parent, event)
                placed, full = self._place(holder, event.block_hashes, owns, parent)
                if self.predicted.holds(instance_id):  # the engine's word replaces the prediction
                    self.predicted.drop(instance_id, owns[:placed])
        except (TypeError, ValueError, RecursionError):
            self.counters.invalid_events += 1
            self._refused(instance_id, "invalid", blocks)
            return
        self.counters.stored_blocks += placed
        if placed < blocks and full:
            self.counters.over_capacity_blocks += blocks - placed
            self._refused(instance_id, "over_capacity", blocks - placed)
        elif placed < blocks:
            self.counters.unknown_parent_blocks += blocks - placed
            self._refused(instance_id, "unknown_parent", blocks - placed)

    def _place(
        self, holder: _Holder, engines: list[BlockHash], owns: list[int], parent: int
    ) -> tuple[int, bool]:
        """Link each engine hash to its own hash, chained from ``parent``; returns how many were
        placed and whether the instance's bound stopped it (else fewer only if relinking a reused
        engine hash dropped the parent). The hot path of ingestion: a new engine hash for a block
        the instance did not hold is handled inline."""
        # Inlined ``_Table.at``, every name a local: the four tables of an instance
        # share one route (they have the same size).
        route, shift, mix, mask64 = holder.engines.route, holder.engines.shift, _MIX, _MASK64
        own_of, held, parents, children = holder.own_of, holder.engines, holder.parent, holder.children
        own_buckets, held_buckets, parent_buckets, child_buckets = (
            own_of.buckets,
            held.buckets,
            parents.buckets,
            children.buckets,
        )
        holders, bit, limit = self._holders, holder.bit, holder.capacity
        masks_route, masks_shift, masks_buckets = holders.route, holders.shift, holders.buckets
        parent_slot = route[_mixed(parent) >> shift]
        for placed, (engine, own) in enumerate(zip(engines, owns, strict=True)):
            own_mixed = (hash(own) * mix) & mask64
            slot = route[own_mixed >> shift]
            engine_slot = route[((hash(engine) * mix) & mask64) >> shift]
            own_bucket = own_buckets[engine_slot] or own_of.made(engine_slot)
            held_bucket = held_buckets[slot] or held.made(slot)
            if engine not in own_bucket and holder.engine_hashes >= limit:
                return placed, True
            if engine in own_bucket or own in held_bucket:
                if not self._link(holder, engine, own, parent):
                    return placed, False
            else:
                own_bucket[engine] = own
                held_bucket[own] = engine
                holder.engine_hashes += 1
                holder.blocks += 1
                self._hold(masks_buckets[masks_route[own_mixed >> masks_shift]], own, bit)  # type: ignore[arg-type]
                (parent_buckets[slot] or parents.made(slot))[own] = parent
                _add(child_buckets[parent_slot] or children.made(parent_slot), parent, own)
            parent, parent_slot = own, slot
        return len(owns), False

    def _hold(self, masks: dict[int, int], own: int, bit: int) -> None:
        """``bit`` holds ``own`` too; ``masks`` is ``own``'s bucket of the table."""
        mask = masks.get(own, 0)
        if not mask:
            self._distinct += 1
        masks[own] = mask | bit

    def _release(self, own: int, bit: int) -> None:
        """``bit`` no longer holds ``own`` (the key goes with the last holder)."""
        bucket = self._holders.of(own)
        mask = bucket[own] & ~bit
        if mask:
            bucket[own] = mask
        else:
            del bucket[own]
            self._distinct -= 1

    def _link(self, holder: _Holder, engine: BlockHash, own: int, parent: int) -> bool:
        """``engine`` now stands for ``own`` (child of ``parent``); False if the parent is gone."""
        own_bucket = holder.own_of.of(engine)
        previous = own_bucket.get(engine)
        if previous == own:
            return True
        if previous is not None:  # the engine reused a hash for other content: the old block is gone
            del own_bucket[engine]
            holder.engine_hashes -= 1
            self._unlink(holder, engine, previous)
            if parent != ROOT_HASH and parent not in holder.engines.of(parent):
                return False
        own_bucket[engine] = own
        holder.engine_hashes += 1
        held_bucket = holder.engines.of(own)
        if own in held_bucket:  # another engine hash for a block already held
            _add(held_bucket, own, engine)
            return True
        held_bucket[own] = engine
        holder.blocks += 1
        self._hold(self._holders.of(own), own, holder.bit)
        holder.parent.of(own)[own] = parent
        _add(holder.children.of(parent), parent, own)
        return True

    def _remove(self, instance_id: str, holder: _Holder, event: BlockRemoved) -> None:
        unknown = 0
        try:
            for engine in event.block_hashes:
                own = holder.own_of.of(engine).pop(engine, None)
                if own is None:
                    unknown += 1
                else:
                    holder.engine_hashes -= 1
                    self._unlink(holder, engine, own)
                    self.counters.removed_blocks += 1
        except TypeError:
            self.counters.invalid_events += 1
            self._refused(instance_id, "invalid", len(event.block_hashes))
        if unknown:
            self.counters.unknown_removed_blocks += unknown
            self._refused(instance_id, "unknown_block", unknown)

    def _unlink(self, holder: _Holder, engine: BlockHash, own: int) -> None:
        """``engine`` no longer stands for ``own``; the block goes when its last engine hash does
        (after its descendants, when it has any: no engine we know removes a block before them)."""
        if not _discard(holder.engines.of(own), own, engine):
            return
        if self.predicted.holds(holder.instance_id):  # a removal wins over a prediction
            self.predicted.drop(holder.instance_id, (own,))
        holder.blocks -= 1
        if own in holder.children.of(own):
            holder.doomed.append(own)
        else:
            self._drop(holder, own)

    def _drop(self, holder: _Holder, own: int) -> None:
        """``own`` leaves the instance (its engine hashes are gone already; it has no children)."""
        self._release(own, holder.bit)
        parent = holder.parent.of(own).pop(own)
        _discard(holder.children.of(parent), parent, own)

    def _drop_doomed(self, holder: _Holder, budget: int) -> None:
        """Drop up to ``budget`` descendants of removed blocks, leaves first, so the instance's
        blocks stay closed under ancestors at every step; each removed block goes after them."""
        stack, orphaned = holder.doomed, 0
        while stack and budget > 0:
            block = stack[-1]
            below = holder.children.of(block).get(block)
            if block not in holder.parent.of(block):  # gone meanwhile (removed by an event)
                stack.pop()
            elif below is not None:
                found = _values(below)
                stack.extend(found)
                budget -= len(found)
            else:
                stack.pop()
                gone = holder.engines.of(block).pop(block, None)  # None: the removed block itself
                if gone is not None:
                    holder.blocks -= 1
                    for engine in gone if isinstance(gone, set) else (gone,):
                        del holder.own_of.of(engine)[engine]
                        holder.engine_hashes -= 1
                    orphaned += 1
                self._drop(holder, block)
                budget -= 1
        if orphaned:
            self.counters.orphaned_blocks += orphaned
            self._warn("kv_blocks_orphaned", holder.instance_id, "removed_before_descendants", orphaned)

    def _retire(self, holder: _Holder) -> None:
        """``holder``'s blocks are no one's from now on; ``_tidy`` takes its bit out of the table."""
        self.predicted.clear(holder.instance_id)
        slot = holder.bit.bit_length() - 1
        self._slots[slot] = None
        self._retiring |= holder.bit
        self._retired.append(holder)

    def _tidy(self, budget: int) -> None:
        """Take up to ``budget`` entries of retired instances out of the table (and free their
        buckets, one at a time: a dropped dict of a million entries is freed in one go); the bit of
        one whose entries are all gone is free for a later instance."""
        while self._retired and budget > 0:
            holder = self._retired[0]
            engines = holder.engines.buckets
            while engines and budget > 0:
                bucket = engines[-1]
                while bucket and budget > 0:
                    self._release(bucket.popitem()[0], holder.bit)
                    budget -= 1
                if not bucket:
                    engines.pop()
            for table in (holder.own_of.buckets, holder.parent.buckets, holder.children.buckets):
                while table and budget > 0:
                    budget -= len(table.pop() or ()) + 1
            if engines or holder.own_of.buckets or holder.parent.buckets or holder.children.buckets:
                return
            self._retired.popleft()
            self._retiring &= ~holder.bit

    def _refused(self, instance_id: str, reason: str, blocks: int) -> None:
        if self._on_refused is not None:
            self._on_refused(reason, blocks)
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


def _run(own_hashes: Sequence[int], held: Callable[[int], bool]) -> int:
    """How many leading ``own_hashes`` are ``held``, by bisection (what an instance holds is closed
    under ancestors)."""
    low, high = 0, len(own_hashes)  # held: all before low; not held: own_hashes[high] (if any)
    while low < high:
        mid = (low + high) // 2
        if held(own_hashes[mid]):
            low = mid + 1
        else:
            high = mid
    return low
