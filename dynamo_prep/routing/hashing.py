"""The frontend's own block hashes: one chained 64-bit int per full block, never the engine's.

A block's own hash is ``hash((parent, tokens))``, or ``hash((parent, tokens, extra))`` when the
block has extra keys, where ``parent`` is the own hash of the block before it (``ROOT_HASH`` for a
sequence's first block), ``tokens`` the hash of the block's token ids as a tuple and ``extra`` one
int standing for the block's extra-key entry. It is computed identically from a request (token ids and
``ImageSpan``s, extra keys by ``mm_extra_keys``) and from an engine's ``BlockStored`` event (its
parent's own hash, token ids and ``extra_keys`` as sent), so the same tokens and images give the
same hashes on both sides whatever hash function the engine uses.

An image is named by what the frontend knows before any fetch: the uuid of its URL. A worker hands
its engine a fetched image's uuid with the digest of the bytes appended (``fetched_image_uuid``), so
the engine's caches tell two images at one URL apart; its events are read back to the URL's part
(``routing_image_uuid``), so the blocks match the request's hashes whatever the bytes were.

Determinism: only ints and tuples of ints are ever passed to Python's ``hash()``. Those hashes are
not salted (``PYTHONHASHSEED`` salts str and bytes only) and are 64-bit on 64-bit CPython; since
CPython 3.8 the tuple hash is an xxHash-style mix with fixed primes. Strings and other values are
first turned into ints by a BLAKE2b digest. The tests pin known answers and compare
processes started with different hash seeds.

Not a cryptographic hash: crafted colliding blocks can only misroute requests, a matter of speed
(the index decides where a request goes, never what it computes).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Final

import msgspec

from dynamo_prep.protocol.kv_events import BlockStored, ImageSpan, mm_extra_keys
from dynamo_prep.protocol.preprocessed import routing_image_uuid

__all__ = [
    "ROOT_HASH",
    "extra_key_id",
    "request_block_hashes",
    "stored_block_hashes",
]

ROOT_HASH: Final = int.from_bytes(b"kvindex", "big")  # the parent of a sequence's first block
_DIGEST_BYTES: Final = 8
_TEXT: Final = b"s"  # domain prefixes: a string and an encoded non-int value never share a digest
_OTHER: Final = b"o"
_LORA: Final = 0x6C6F_7261  # ("lora") tags the extra of every block of a LoRA event
_ID_CACHE_SIZE: Final = 4096
_ID_CACHE_CHARS: Final = 256  # longer strings (a peer's, not an image id) are not cached
_encoder = msgspec.msgpack.Encoder()


def request_block_hashes(
    token_ids: Sequence[int], block_size: int, images: Sequence[ImageSpan] = ()
) -> list[int]:
    """Own hashes of the request's full blocks (a partial last block has none).

    ``images`` are the prompt's images in prompt order, positions in ``token_ids``.
    """
    return _chain(ROOT_HASH, token_ids, block_size, _image_extras(images, block_size, len(token_ids)))


def stored_block_hashes(parent: int | None, event: BlockStored) -> list[int]:
    """Own hashes of the blocks of ``event``; ``parent`` is the own hash of its parent block (None
    or ``ROOT_HASH``: the event's first block starts a sequence).

    The event's ``extra_keys`` entries count as sent (an empty or None entry is no extra), and a
    LoRA event (``lora_name`` or ``lora_id`` set) tags every block, so an adapter's blocks never
    match a plain request even from an older engine that sends no extra keys. Raises
    ``ValueError`` (or ``RecursionError``, ``TypeError``) on an entry it cannot canonicalise.
    """
    root = ROOT_HASH if parent is None else parent
    return _chain(root, event.token_ids, event.block_size, _event_extras(event))


def _text_id(text: str) -> int:
    return _cached_text_id(text) if len(text) <= _ID_CACHE_CHARS else _digest(_TEXT, text)


@functools.lru_cache(maxsize=_ID_CACHE_SIZE)
def _cached_text_id(text: str) -> int:
    return _digest(_TEXT, routing_image_uuid(text))  # an image identity is short: always cached


def _digest(domain: bytes, value: str | bytes) -> int:
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return int.from_bytes(hashlib.blake2b(domain + data, digest_size=_DIGEST_BYTES).digest(), "little")


def _canonical(value: Any) -> Any:
    """``value`` as ints and tuples of ints only (safe to pass to ``hash()``)."""
    if isinstance(value, str):
        return _text_id(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list | tuple):
        return tuple(_canonical(item) for item in value)
    try:
        return _digest(_OTHER, _encoder.encode(value))
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"an extra key of type {type(value).__name__} cannot be hashed") from exc


def extra_key_id(entry: Any) -> int | None:
    """The int standing for one block's extra-key entry; None when the block has no extra keys."""
    if not entry:
        return None
    return hash(_canonical(entry))


def _image_extras(images: Sequence[ImageSpan], block_size: int, token_count: int) -> dict[int, int]:
    """Block index -> extra of every full block that overlaps an image.

    Spans in prompt order (starts and ends never decreasing, as ``image_spans`` finds them) are
    swept once: the images a block can overlap are a window that only moves forward, so the cost is
    O(images + blocks they cover). Spans out of that order fall back to testing every image.
    """
    if not images:
        return {}
    blocks = token_count // block_size
    ordered = all(
        a.start <= b.start and a.start + a.length <= b.start + b.length for a, b in itertools.pairwise(images)
    )
    extras: dict[int, int] = {}
    low = high = 0
    for span in images:
        # Every block the overlap rule can select (mm_extra_keys decides which really overlap).
        first = max(span.start // block_size, 0)
        last = min((span.start + span.length - 1) // block_size, blocks - 1)
        for index in range(first, last + 1):
            if index in extras:
                continue
            block_start = index * block_size
            window: Sequence[ImageSpan] = images
            if ordered:
                while low < len(images) and images[low].start + images[low].length <= block_start:
                    low += 1
                high = max(high, low)
                while high < len(images) and images[high].start < block_start + block_size:
                    high += 1
                window = images[low:high]
            extra = extra_key_id(mm_extra_keys(window, block_start, block_size))
            if extra is not None:
                extras[index] = extra
    return extras


def _event_extras(event: BlockStored) -> dict[int, int]:
    keys = event.extra_keys
    lora = event.lora_name if event.lora_name is not None else event.lora_id
    if lora is None:
        if not keys:
            return {}
        extras = {index: extra_key_id(entry) for index, entry in enumerate(keys)}
        return {index: extra for index, extra in extras.items() if extra is not None}
    tag = hash((_LORA, _canonical(lora)))
    entries = keys or [None] * len(event.block_hashes)
    return {index: hash((tag, extra_key_id(entry) or 0)) for index, entry in enumerate(entries)}


def _block_ids(token_ids: Sequence[int], block_size: int) -> Iterator[int]:
    """``hash(tuple(block))`` of every full block, all in C: ``zip`` reuses its result tuple when
    ``hash`` has released it, so no tuple is allocated per block."""
    return map(hash, zip(*[iter(token_ids)] * block_size, strict=False))


def _chain(parent: int, token_ids: Sequence[int], block_size: int, extras: dict[int, int]) -> list[int]:
    """The chained hashes of every full block: the hot path (one small tuple hash per block)."""
    if not extras:
        # All in C: the list is extended from an iterator over itself, so each (parent, block)
        # pair reads the hash appended just before it.
        hashes = [parent]
        hashes.extend(map(hash, zip(iter(hashes), _block_ids(token_ids, block_size), strict=False)))
        del hashes[0]
        return hashes
    hashes = []
    append = hashes.append
    for index, block in enumerate(_block_ids(token_ids, block_size)):
        extra = extras.get(index)
        parent = hash((parent, block)) if extra is None else hash((parent, block, extra))
        append(parent)
    return hashes
