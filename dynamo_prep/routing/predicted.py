"""Blocks counted as cached on an instance before its engine says so: the prompt blocks of the
requests routed there (docs/kv-events.md, "Predicted blocks").

An entry is pinned while a request that made it waits for its first token, then lives ``ttl_s``
more. The engine's own events replace it (a store of the block) or refute it (a removal, a clear,
a reset): either drops it at once, pinned or not. Matching extends an instance's cached run (its
own events') by its predicted blocks that follow it, one lookup per block.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_PREDICT_TTL_S", "PredictedBlocks"]

# Long enough for the engine's events of a prefill to reach the frontend after its first token.
DEFAULT_PREDICT_TTL_S: Final = 2.0


@dataclass(slots=True)
class _Entry:
    pins: int  # requests that predicted the block and have not had their first token yet
    expires: float = 0.0  # when pins is 0


class PredictedBlocks:
    """Own hash -> the instances predicted to hold it. Not thread-safe (the router's loop only)."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"the prediction time-to-live must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._table: dict[int, dict[str, _Entry]] = {}
        self._held: dict[str, set[int]] = {}  # instance -> its predicted hashes
        self._expiring: deque[tuple[float, str, Sequence[int]]] = deque()  # in expiry order

    def count(self) -> int:
        """Predicted blocks now (the expired ones dropped first), all instances together."""
        self._purge()
        return sum(len(hashes) for hashes in self._held.values())

    def __bool__(self) -> bool:
        return bool(self._held)

    def holds(self, instance_id: str) -> bool:
        return instance_id in self._held

    def pin(self, instance_id: str, own_hashes: Sequence[int], limit: int) -> Sequence[int]:
        """``own_hashes`` (a chain from the instance's cached run on) are predicted there until
        ``unpin``; at most ``limit`` per instance (the leading ones). Returns the hashes pinned."""
        if not self.ttl_s or not own_hashes:
            return ()
        self._purge()
        held = self._held.setdefault(instance_id, set())
        pinned = own_hashes[: max(limit - len(held), 0)]
        for own in pinned:
            holders = self._table.setdefault(own, {})
            entry = holders.get(instance_id)
            if entry is None:
                holders[instance_id] = _Entry(1)
                held.add(own)
            else:
                entry.pins += 1
        if not held:
            del self._held[instance_id]
        return pinned

    def unpin(self, instance_id: str, own_hashes: Sequence[int]) -> None:
        """The request that pinned ``own_hashes`` had its first token (or ended): its entries live
        ``ttl_s`` more unless another request still pins them."""
        if not own_hashes or instance_id not in self._held:
            return
        expires = self._clock() + self.ttl_s
        for own in own_hashes:
            entry = self._table.get(own, {}).get(instance_id)
            if entry is not None and entry.pins:
                entry.pins -= 1
                entry.expires = expires
        self._expiring.append((expires, instance_id, own_hashes))
        self._purge()

    def drop(self, instance_id: str, own_hashes: Iterable[int]) -> None:
        """The engine's own events speak of these blocks (stored or removed): no prediction left."""
        held = self._held.get(instance_id)
        if held is None:
            return
        for own in own_hashes:
            if own in held:
                held.discard(own)
                self._forget(own, instance_id)
        if not held:
            del self._held[instance_id]

    def clear(self, instance_id: str) -> None:
        """Every prediction of the instance goes (it cleared its cache, was reset, or left)."""
        for own in self._held.pop(instance_id, ()):
            self._forget(own, instance_id)

    def extend(self, own_hashes: Sequence[int], found: dict[str, int]) -> None:
        """Lengthen each instance's run in ``found`` (cached blocks from the first, by its events)
        by the predicted blocks that follow it; add instances whose run is predicted from the first."""
        if not own_hashes or not self._held:
            return
        self._purge()
        count, table = len(own_hashes), self._table
        first = table.get(own_hashes[0], {})
        for instance_id in {*found, *first}:
            depth = found.get(instance_id, 0)
            while depth < count and instance_id in table.get(own_hashes[depth], ()):
                depth += 1
            if depth:
                found[instance_id] = depth

    def _forget(self, own: int, instance_id: str) -> None:
        holders = self._table[own]
        del holders[instance_id]
        if not holders:
            del self._table[own]

    def _purge(self) -> None:
        """Drop the unpinned entries whose time is up (records come in expiry order)."""
        now = self._clock()
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            _, instance_id, own_hashes = expiring.popleft()
            held = self._held.get(instance_id)
            if held is None:
                continue
            for own in own_hashes:
                entry = self._table.get(own, {}).get(instance_id)
                if entry is not None and not entry.pins and entry.expires <= now:
                    held.discard(own)
                    self._forget(own, instance_id)
            if not held:
                del self._held[instance_id]
