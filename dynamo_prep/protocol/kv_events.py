"""The engines' KV-cache event wire: vLLM's ``vllm/distributed/kv_events.py`` (SGLang copies it).

Live frames are ``[topic, seq, payload]``: ``seq`` a u64 big-endian counter from 0 per publisher,
``payload`` a MessagePack ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` (``ts`` is the
engine's ``time.monotonic()``, not wall time). Events are tagged structs: maps with a ``"type"``
key in current vLLM, positional arrays with the tag first before vLLM PR #42892. Both decode to
the same classes below; block hashes are ``int`` or ``bytes`` (opaque to us). We write every field
of vLLM's structs, in vLLM's order, defaults included: vLLM's own decoder requires ``lora_id``,
``medium`` and ``lora_name`` (no defaults there), and ours fills in what older engines leave out.

Replay: a DEALER sends ``[b"", start_seq]`` to the publisher's ROUTER, which answers
``[b"", topic, seq, payload]`` for each buffered batch with ``seq >= start_seq`` (older vLLM:
``[b"", seq, payload]``), then ``[b"", b"", END_SEQ, b""]`` (older: ``[b"", END_SEQ, b""]``).

Everything is validated here, once: a consumer gets typed events whose block arithmetic holds
(``len(token_ids) == len(block_hashes) * block_size``) or a ``KvEventDecodeError`` whose
``reason`` is a stable label for metrics and logs. An event of an unknown type is skipped and
reported, not fatal to its batch. Decoding costs O(bytes): a batch claiming more events than its
bytes can hold (``MIN_EVENT_BYTES`` each on average) is refused whole before any is looked at, and a
skipped event is a count, not a kept object. ``open_batch`` and ``decode_event`` let a consumer
decode a batch's events one at a time (the follower applies long batches in slices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec

from dynamo_prep.protocol.decode import WireDecodeError, decoding

__all__ = [
    "END_SEQ",
    "MAX_BATCH_BYTES",
    "MAX_EVENT_BYTES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "ImageSpan",
    "KVEvent",
    "KVEventBatch",
    "KvEventDecodeError",
    "RawEventBatch",
    "ReplayFrame",
    "decode_batch",
    "decode_event",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "mm_extra_keys",
    "open_batch",
    "parse_live",
    "parse_replay",
    "replay_request",
]

BlockHash = int | bytes
# A batch is scanned in one step (about 2.5 ms per MB) and one event decoded in one step (its lists
# whole: about 12 ms per MB): above these they are skipped (``too_large``). vLLM publishes a batch
# per engine step, one event per request: at 131,072 tokens a step both stay under 1 MB.
MAX_BATCH_BYTES: Final = 4 << 20
MAX_EVENT_BYTES: Final = 1 << 20
MAX_HASH_BYTES: Final = 64
# The smallest event of either form is 18 bytes (``["AllBlocksCleared"]``), a future map event at
# least ``{"type": ...}`` with a name: a batch with fewer bytes per event than this is garbage.
MIN_EVENT_BYTES: Final = 16
EVENTS_SLACK: Final = 16  # ... beyond this many events, so a short batch is never refused for it
SEQ_BYTES: Final = 8
END_SEQ: Final = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


class KvEventDecodeError(WireDecodeError):
    """A KV-event frame or payload that cannot be used; ``reason`` is a stable snake_case label.

    Reasons: ``frame_count``, ``bad_seq``, ``too_large``, ``undecodable``, ``too_deep``,
    ``invalid``, ``too_many_events``, ``unknown_event``.
    """


# A block hash as the wire may carry it: checked while decoding, in C (not per hash in Python).
_WireHash = int | Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    """Full blocks entered the engine's prefix cache, chained to ``parent_block_hash``.

    ``token_ids`` holds every token of the stored blocks, concatenated; ``extra_keys`` has one
    entry per block (LoRA name, ``(mm identifier, offset in block)`` pairs, cache salt) or is None.
    Field order is vLLM's (it is the positional order of the old array form).
    """

    block_hashes: list[_WireHash]
    parent_block_hash: _WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    """Blocks left the engine's cache (evicted)."""

    block_hashes: list[_WireHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    """The engine dropped its whole prefix cache (e.g. ``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """One published step: ``[ts, events, data_parallel_rank]`` (positional: all three, always)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class DecodedBatch(msgspec.Struct, frozen=True):
    """A decoded batch and the events it skipped: how many per reason, and the first error of each
    reason (never one object per skipped event)."""

    batch: KVEventBatch
    skipped: list[KvEventDecodeError]
    skipped_counts: dict[str, int] = {}


class ReplayFrame(msgspec.Struct, frozen=True):
    """One reply of the replay ROUTER: a batch (``payload``), or the end marker (``end``)."""

    seq: int
    payload: bytes
    end: bool = False


class RawEventBatch(msgspec.Struct):
    """A batch whose events are still encoded (``decode_event`` each), as ``open_batch`` returns it."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


class _RawBatchMap(msgspec.Struct):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct):
    type: str = ""


# Fields the old positional form always carried (vLLM's required ones, through ``medium``).
_OLD_FIELDS: Final[dict[type[KVEvent], int]] = {BlockStored: 6, BlockRemoved: 2, AllBlocksCleared: 0}
_EVENT_TYPES: Final[dict[str, type[KVEvent]]] = {str(cls.__struct_config__.tag): cls for cls in _OLD_FIELDS}
_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_batch_map_decoder = msgspec.msgpack.Decoder(_RawBatchMap)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)
_array_decoder = msgspec.msgpack.Decoder(list[Any])
_events_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_tag_decoder = msgspec.msgpack.Decoder(_Tag)


# -- frames ------------------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """A u64 big-endian sequence number; anything else is ``bad_seq``."""
    if len(frame) != SEQ_BYTES:
        raise KvEventDecodeError("bad_seq", f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def parse_live(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``[topic, seq, payload]`` of a live message (payload still encoded)."""
    if len(frames) != 3:
        raise KvEventDecodeError("frame_count", f"{len(frames)} frames, expected [topic, seq, payload]")
    topic, seq, payload = frames
    return topic, decode_seq(seq), payload


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay ROUTER to get every buffered batch from ``start_seq`` on."""
    return [b"", encode_seq(start_seq)]


def parse_replay(frames: list[bytes]) -> ReplayFrame:
    """One reply as a DEALER receives it: ``[b"", topic, seq, payload]`` or the older
    ``[b"", seq, payload]``; ``seq == END_SEQ`` ends the replay."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise KvEventDecodeError(
            "frame_count", f"{len(frames)} frames, expected [b'', topic, seq, payload] or [b'', seq, payload]"
        )
    seq_frame, payload = frames[-2], frames[-1]
    if seq_frame == END_SEQ:
        return ReplayFrame(seq=-1, payload=b"", end=True)
    return ReplayFrame(seq=decode_seq(seq_frame), payload=payload)


# -- payloads ----------------------------------------------------------------------------------


def encode_batch(batch: KVEventBatch, *, shape: Literal["map", "array"] = "map") -> bytes:
    """A batch as current vLLM sends it (events as maps), or as vLLM did before PR #42892."""
    if shape == "map":
        return _encoder.encode(batch)
    events = [_positional(event) for event in batch.events]
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])


def decode_batch(payload: bytes | memoryview) -> DecodedBatch:
    """Typed, checked events of one batch; a bad batch raises, a bad event is skipped (counted)."""
    raw = open_batch(payload)
    events: list[KVEvent] = []
    first: dict[str, KvEventDecodeError] = {}
    counts: dict[str, int] = {}
    for item in raw.events:
        try:
            events.append(decode_event(item))
        except KvEventDecodeError as exc:
            counts[exc.reason] = counts.get(exc.reason, 0) + 1
            first.setdefault(exc.reason, exc)
    batch = KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)
    return DecodedBatch(batch=batch, skipped=list(first.values()), skipped_counts=counts)


def open_batch(payload: bytes | memoryview) -> RawEventBatch:
    """A batch with its events still encoded: O(1) objects per ``MIN_EVENT_BYTES`` of payload."""
    if len(payload) > MAX_BATCH_BYTES:
        raise KvEventDecodeError("too_large", f"{len(payload)} bytes > {MAX_BATCH_BYTES}")
    first = bytes(payload[:1])
    decoder = _batch_map_decoder if first and _is_map(first[0]) else _batch_decoder
    raw: _RawBatch | _RawBatchMap = _guarded(decoder, payload)
    count = _array_length(memoryview(raw.events))
    if count > EVENTS_SLACK + len(raw.events) // MIN_EVENT_BYTES:
        raise KvEventDecodeError("too_many_events", f"{count} events in {len(raw.events)} bytes")
    events: list[msgspec.Raw] = _guarded(_events_decoder, raw.events)
    return RawEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)


def _array_length(data: memoryview) -> int:
    """The length in a MessagePack array header (the events of a batch the decoder has read)."""
    first = data[0] if data else -1
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first in (0xDC, 0xDD):
        return int.from_bytes(data[1 : 3 if first == 0xDC else 5], "big")
    raise KvEventDecodeError("invalid", "a batch's events must be an array")


def decode_event(raw: msgspec.Raw) -> KVEvent:
    """One typed, checked event of a batch (``KvEventDecodeError`` when it must be skipped)."""
    data = memoryview(raw)
    if len(data) > MAX_EVENT_BYTES:
        raise KvEventDecodeError("too_large", f"an event of {len(data)} bytes > {MAX_EVENT_BYTES}")
    if not data or not (_is_map(data[0]) or _is_array(data[0])):
        raise KvEventDecodeError("invalid", "an event must be a map or an array")
    event = _decode_map_event(raw) if _is_map(data[0]) else _decode_array_event(raw)
    _check(event)
    return event


def _decode_map_event(raw: msgspec.Raw) -> KVEvent:
    try:
        event: KVEvent = _guarded(_event_decoder, raw)
    except KvEventDecodeError as exc:
        tag = _guarded(_tag_decoder, raw).type if exc.reason == "invalid" else ""
        if exc.reason == "invalid" and tag not in _EVENT_TYPES:
            raise KvEventDecodeError("unknown_event", f"type={tag[:64]!r}") from exc
        raise
    return event


def _decode_array_event(raw: msgspec.Raw) -> KVEvent:
    items = _guarded(_array_decoder, raw)
    tag = items[0] if items else None
    cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise KvEventDecodeError("unknown_event", f"type={str(tag)[:64]!r}")
    fields = cls.__struct_fields__
    if len(items) - 1 > len(fields):
        raise KvEventDecodeError("invalid", f"{tag} has {len(items) - 1} fields, at most {len(fields)} known")
    with decoding(KvEventDecodeError):
        event: KVEvent = msgspec.convert(dict(zip(fields, items[1:], strict=False)), cls)
    return event


def _check(event: KVEvent) -> None:
    """Block arithmetic: what a typed decode cannot state (hash sizes are checked by the decoder)."""
    if not isinstance(event, BlockStored):
        return
    if event.block_size < 1:
        raise KvEventDecodeError("invalid", f"block_size {event.block_size} < 1")
    blocks = len(event.block_hashes)
    if len(event.token_ids) != blocks * event.block_size:
        raise KvEventDecodeError(
            "invalid",
            f"{len(event.token_ids)} token ids for {blocks} block(s) of {event.block_size}: "
            "not a whole number of blocks",
        )
    if event.extra_keys is not None and len(event.extra_keys) != blocks:
        raise KvEventDecodeError(
            "invalid", f"{len(event.extra_keys)} extra_keys entries for {blocks} block(s)"
        )


def _positional(event: KVEvent) -> list[Any]:
    """``[tag, field, ...]`` as vLLM sent it before PR #42892: its fields up to ``medium`` always,
    later ones only up to the last that is not at its default."""
    cls = type(event)
    values = list(msgspec.structs.astuple(event))
    defaults = cls.__struct_defaults__
    first_default = len(values) - len(defaults)
    while len(values) > _OLD_FIELDS[cls] and values[-1] == defaults[len(values) - 1 - first_default]:
        values.pop()
    return [cls.__struct_config__.tag, *values]


def _guarded(decoder: msgspec.msgpack.Decoder[Any], payload: Any) -> Any:
    with decoding(KvEventDecodeError):
        return decoder.decode(payload)


def _is_map(byte: int) -> bool:
    return 0x80 <= byte <= 0x8F or byte in (0xDE, 0xDF)


def _is_array(byte: int) -> bool:
    return 0x90 <= byte <= 0x9F or byte in (0xDC, 0xDD)


# -- multimodal extra keys ---------------------------------------------------------------------


class ImageSpan(msgspec.Struct, frozen=True):
    """One image in a prompt: its identity and the token positions ``[start, start + length)`` it
    occupies (its placeholder ids as rendered for the engine that receives the prompt).

    ``identifier`` is the image's identity (the multimodal UUID the frontend sends the engine: a
    content hash of the image URL or data), so blocks covering different images never share a hash.
    """

    identifier: str
    start: int
    length: int


def mm_extra_keys(spans: Sequence[ImageSpan], block_start: int, block_size: int) -> list[tuple[str, int]]:
    """The ``(identifier, offset)`` pairs of the block ``[block_start, block_start + block_size)``.

    vLLM's rule, the one home of it: one pair per image overlapping the block, in the order of
    ``spans`` (prompt order), with ``offset = image start - block_start`` (negative when the image
    began in an earlier block). An image overlaps the block when it starts before the block ends
    and ends after the block starts. An empty list means the block has no image.
    """
    block_end = block_start + block_size
    return [
        (span.identifier, span.start - block_start)
        for span in spans
        if span.start < block_end and span.start + span.length > block_start
    ]


def placeholder_starts(
    token_ids: Sequence[int], pattern: Sequence[int], limit: int | None = None
) -> list[int]:
    """Start positions of the non-overlapping occurrences of ``pattern`` (an image placeholder's
    ids) in ``token_ids``, left to right: where each image of a prompt sits, in prompt order. At
    most ``limit`` of them."""
    if not pattern:
        return []
    width = len(pattern)
    # Scan for the pattern's highest id: BPE ranks rise with rarity, so it is the rarest guess
    # (a shattered placeholder often starts with a common piece such as "<").
    anchor = max(range(width), key=pattern.__getitem__)
    probe, target = pattern[anchor], list(pattern)
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    starts: list[int] = []
    position, last = anchor, len(ids) - width + anchor
    while position <= last and (limit is None or len(starts) < limit):
        try:
            position = ids.index(probe, position, last + 1)
        except ValueError:
            break
        start = position - anchor
        if width == 1 or ids[start : start + width] == target:
            starts.append(start)
            position += width
        else:
            position += 1
    return starts


def image_spans(
    token_ids: Sequence[int], placeholder: Sequence[int], identifiers: Sequence[str]
) -> list[ImageSpan]:
    """The prompt's images as spans: the k-th occurrence of ``placeholder`` is the k-th image.

    Fewer occurrences than identifiers (the engine expands images itself, or the prompt was cut)
    give spans for the ones found; extra occurrences have no identity and are left out.
    """
    starts = placeholder_starts(token_ids, placeholder, len(identifiers)) if identifiers else []
    return [
        ImageSpan(identifier=identifier, start=start, length=len(placeholder))
        for identifier, start in zip(identifiers, starts, strict=False)
    ]
