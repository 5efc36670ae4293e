"""The mock engine's paged prefix cache: vLLM's prefix caching, without a GPU.

A prompt's full blocks are looked up by chained engine hash; the longest cached prefix is reused
(the caller charges prefill only for the rest) and every block the request uses is referenced
until it is released. Blocks nobody references stay cached and are evicted least recently used
first when a new block needs room; if every block is referenced, what does not fit is not cached.
Each change is recorded as the event vLLM publishes (``BlockStored`` with the blocks' token ids
and extra keys, ``BlockRemoved``), for a publisher to drain with ``take_events``.

Engine hashes are SHA-256 of (seed, parent hash, token ids, extra keys), as bytes or as a 64-bit
int (``hash_kind``, like ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): deliberately not the
frontend's function, which must never depend on them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from dynamo_prep.protocol.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    ImageSpan,
    KVEvent,
    mm_extra_keys,
)

__all__ = ["MEDIUM", "HashKind", "PagedPrefixCache"]

HashKind = Literal["bytes", "int"]
MEDIUM: Final = "GPU"
_INT_HASH_BYTES: Final = 8
_encoder = msgspec.msgpack.Encoder()


@dataclass(slots=True)
class _Admitted:
    """A running request: its tokens and images, and the blocks it references (a chain from block 0)."""

    token_ids: list[int]
    images: Sequence[ImageSpan]
    blocks: list[BlockHash] = field(default_factory=list)
    complete: bool = True  # every full block of the prompt is cached (none overflowed)


class PagedPrefixCache:
    """Prefix cache of ``capacity_blocks`` blocks of ``block_size`` tokens, emitting vLLM's KV events."""

    def __init__(
        self, block_size: int, capacity_blocks: int, *, hash_kind: HashKind = "bytes", seed: bytes = b""
    ) -> None:
        if block_size < 1 or capacity_blocks < 0:
            raise ValueError(
                f"block_size must be >= 1 and capacity_blocks >= 0, got {block_size}, {capacity_blocks}"
            )
        if hash_kind not in ("bytes", "int"):
            raise ValueError(f"hash_kind must be 'bytes' or 'int', got {hash_kind!r}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.hash_kind: HashKind = hash_kind
        self._seed = seed
        self._refs: dict[BlockHash, int] = {}  # every cached block -> requests referencing it
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # unreferenced blocks, oldest first
        self._requests: dict[str, _Admitted] = {}
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        """Blocks cached (referenced or not)."""
        return len(self._refs)

    def admit(self, request_id: str, token_ids: Sequence[int], images: Sequence[ImageSpan] = ()) -> int:
        """Start a request: reuse its longest cached prefix, cache its new full blocks, reference all.

        Returns the prompt tokens whose KV is reused, so prefill costs only the rest. As in vLLM,
        at least one token is always computed: a prompt cached to its last token reuses one block
        less. ``images`` are the prompt's images in prompt order.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        request = self._requests[request_id] = _Admitted(list(token_ids), images)
        hits = self._extend(request, len(request.token_ids) // self.block_size)
        usable = max(len(request.token_ids) - 1, 0) // self.block_size
        return min(hits, usable) * self.block_size

    def release(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """End a request: cache the full blocks its generated tokens completed (vLLM caches decode
        blocks too, so a follow-up turn that repeats the answer hits them), then unreference its
        blocks, the last block first in line for eviction. Unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.complete and output_token_ids:
            request.token_ids.extend(output_token_ids)
            self._extend(request, len(request.token_ids) // self.block_size)
        for block_hash in reversed(request.blocks):
            count = self._refs[block_hash] - 1
            self._refs[block_hash] = count
            if not count:
                self._lru[block_hash] = None

    def reset(self) -> bool:
        """Drop every cached block (``AllBlocksCleared``); refused (False) while a request runs, as
        vLLM's ``reset_prefix_cache`` is."""
        if self._requests:
            return False
        self._refs.clear()
        self._lru.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order."""
        events, self._events = self._events, []
        return events

    def block_hashes(self, token_ids: Sequence[int], images: Sequence[ImageSpan] = ()) -> list[BlockHash]:
        """Engine hashes of the full blocks of ``token_ids`` (cached or not)."""
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for index in range(len(token_ids) // self.block_size):
            parent = self._hash(parent, *self._block(token_ids, images, index))
            hashes.append(parent)
        return hashes

    # -- internals -----------------------------------------------------------------------------

    def _extend(self, request: _Admitted, full_blocks: int) -> int:
        """Reference or cache the request's blocks up to ``full_blocks``; returns the cached ones it
        reused. Once a block is missing every later one is: a cached block's parent is always
        cached (it is referenced whenever the child is, and released after it, so evicted later)."""
        removed: list[BlockHash] = []
        run: BlockStored | None = None
        hits = 0
        parent = request.blocks[-1] if request.blocks else None
        for index in range(len(request.blocks), full_blocks):
            tokens, extra = self._block(request.token_ids, request.images, index)
            block_hash = self._hash(parent, tokens, extra)
            if run is None and block_hash in self._refs:
                self._reference(block_hash)
                hits += 1
            elif block_hash in self._refs or not self._make_room(removed):
                request.complete = False  # full (or a hash collision): the rest is not cached
                break
            else:
                self._refs[block_hash] = 1
                run = self._grow(run, parent, block_hash, tokens, extra)
            request.blocks.append(block_hash)
            parent = block_hash
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        if run is not None:
            self._events.append(run)
        return hits

    def _block(
        self, token_ids: Sequence[int], images: Sequence[ImageSpan], index: int
    ) -> tuple[list[int], list[tuple[str, int]] | None]:
        start = index * self.block_size
        return list(token_ids[start : start + self.block_size]), mm_extra_keys(
            images, start, self.block_size
        ) or None

    def _hash(
        self, parent: BlockHash | None, tokens: list[int], extra: list[tuple[str, int]] | None
    ) -> BlockHash:
        digest = hashlib.sha256(self._seed + _encoder.encode((parent, tokens, extra))).digest()
        if self.hash_kind == "int":
            return int.from_bytes(digest[:_INT_HASH_BYTES], "big")
        return digest

    def _reference(self, block_hash: BlockHash) -> None:
        count = self._refs[block_hash]
        if not count:
            del self._lru[block_hash]
        self._refs[block_hash] = count + 1

    def _make_room(self, removed: list[BlockHash]) -> bool:
        if len(self._refs) < self.capacity_blocks:
            return True
        if not self._lru:
            return False
        victim, _ = self._lru.popitem(last=False)
        del self._refs[victim]
        removed.append(victim)
        return True

    def _grow(
        self,
        run: BlockStored | None,
        parent: BlockHash | None,
        block_hash: BlockHash,
        tokens: list[int],
        extra: list[tuple[str, int]] | None,
    ) -> BlockStored:
        """The admission's ``BlockStored`` with one more block (extra keys: one entry per block, or
        None while no block has any)."""
        if run is None:
            extra_keys = None if extra is None else [extra]
            return BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                medium=MEDIUM,
                extra_keys=extra_keys,
            )
        run.block_hashes.append(block_hash)
        run.token_ids.extend(tokens)
        if extra is not None and run.extra_keys is None:
            run.extra_keys = [None] * (len(run.block_hashes) - 1)
        if run.extra_keys is not None:
            run.extra_keys.append(extra)
        return run
