"""PagedPrefixCache: prefix reuse, references, LRU eviction, decode blocks, images, and its events."""

from __future__ import annotations

import msgspec
import pytest
from support import kv_wire
from support.kv_wire import REMOVED_FIELDS, STORED_FIELDS

from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.models import DEMO_MODELS_DIR
from dynamo_prep.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ImageSpan,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from dynamo_prep.tokenizer import Tokenizer

BS = 4


def blocks(first: int, count: int) -> list[int]:
    """``count`` blocks of distinct tokens, starting at token ``first``."""
    return list(range(first, first + count * BS))


def test_a_prompt_reuses_the_longest_cached_prefix_and_stores_the_rest() -> None:
    cache = PagedPrefixCache(BS, 100)
    shared = blocks(0, 2)
    assert cache.admit("a", [*shared, *blocks(100, 2)]) == 0
    first = cache.take_events()
    cache.release("a")
    assert cache.admit("b", [*shared, *blocks(200, 3), 9]) == 2 * BS
    [event] = cache.take_events()
    assert isinstance(event, BlockStored)
    a_hashes = first[0].block_hashes  # type: ignore[union-attr]
    assert event.parent_block_hash == a_hashes[1]
    assert event.token_ids == blocks(200, 3) and len(event.block_hashes) == 3
    assert event.block_size == BS and event.medium == "GPU" and event.extra_keys is None
    assert len(cache) == 7


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    cache = PagedPrefixCache(BS, 100)
    prompt = blocks(0, 3)
    cache.admit("a", prompt)
    cache.release("a")
    assert cache.admit("b", prompt) == 2 * BS  # vLLM: the last block is recomputed
    assert cache.admit("c", [*prompt, 7]) == 3 * BS
    assert cache.admit("d", []) == 0


def test_lru_eviction_takes_the_least_recently_used_tail_first_and_emits_block_removed() -> None:
    cache = PagedPrefixCache(BS, 4, hash_kind="int")
    a, b = blocks(0, 2), blocks(100, 2)
    for request_id, prompt in (("a", a), ("b", b), ("a2", a)):  # a is used again: b is now the oldest
        cache.admit(request_id, prompt)
        cache.release(request_id)
    b_hashes = cache.block_hashes(b)
    cache.take_events()
    cache.admit("c", blocks(200, 2))
    removed, stored = cache.take_events()
    assert isinstance(removed, BlockRemoved) and isinstance(stored, BlockStored)
    assert removed.block_hashes == [b_hashes[1], b_hashes[0]] and removed.medium == "GPU"
    assert stored.parent_block_hash is None
    assert cache.admit("a3", a) == BS  # a survived (its last block is recomputed, as always)


def test_referenced_blocks_are_never_evicted_and_the_overflow_is_not_cached() -> None:
    cache = PagedPrefixCache(BS, 4)
    cache.admit("x", blocks(0, 4))
    cache.take_events()
    assert cache.admit("y", blocks(100, 2)) == 0
    assert cache.take_events() == [] and len(cache) == 4
    cache.release("y", blocks(500, 2))  # y's prompt was not cached: its decode blocks are not either
    assert cache.take_events() == []
    cache.release("x")
    cache.admit("z", blocks(100, 2))
    removed, stored = cache.take_events()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2


def test_a_prompt_larger_than_the_free_room_caches_its_head_only() -> None:
    cache = PagedPrefixCache(BS, 3)
    cache.admit("a", blocks(0, 5))
    [stored] = cache.take_events()
    assert isinstance(stored, BlockStored) and stored.token_ids == blocks(0, 3)
    cache.release("a", blocks(100, 3))
    assert cache.take_events() == []  # the chain broke at block 3: nothing after it is cached
    assert cache.admit("b", blocks(0, 5)) == 3 * BS


def test_generated_tokens_fill_blocks_that_are_stored_at_release_and_hit_by_the_next_turn() -> None:
    cache = PagedPrefixCache(BS, 100, hash_kind="int")
    prompt = [*blocks(0, 2), 900, 901]  # two full blocks and a partial one
    answer = [950 + i for i in range(7)]
    cache.admit("turn1", prompt)
    [stored] = cache.take_events()
    cache.release("turn1", answer)
    [decode] = cache.take_events()
    assert isinstance(stored, BlockStored) and isinstance(decode, BlockStored)
    assert decode.parent_block_hash == stored.block_hashes[-1]
    assert decode.token_ids == [900, 901, *answer[:6]]  # the prompt's tail completes a block
    follow_up = [*prompt, *answer, *blocks(300, 2)]
    assert cache.admit("turn2", follow_up) == 4 * BS


def test_blocks_are_held_while_any_request_references_them() -> None:
    cache = PagedPrefixCache(BS, 3)
    shared = blocks(0, 2)
    cache.admit("a", shared)
    cache.admit("b", [*shared, 5])
    cache.release("a")
    cache.admit("c", blocks(100, 1))  # fills the last free block
    cache.take_events()
    cache.admit("d", blocks(200, 1))  # nothing is free: b still holds the shared blocks
    assert cache.take_events() == []
    cache.release("b")
    cache.admit("e", blocks(300, 1))
    removed, _ = cache.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [cache.block_hashes(shared)[1]]


def test_prompts_differing_only_in_an_image_share_the_blocks_before_it_only() -> None:
    cache = PagedPrefixCache(BS, 100)
    prompt = blocks(0, 6)
    cat, dog = [ImageSpan("sha256:cat", 9, 6)], [ImageSpan("sha256:dog", 9, 6)]
    cache.admit("a", prompt, cat)
    [first] = cache.take_events()
    assert isinstance(first, BlockStored)
    assert first.extra_keys == [None, None, [("sha256:cat", 1)], [("sha256:cat", -3)], None, None]
    assert cache.admit("b", prompt, dog) == 2 * BS  # blocks 0 and 1 end before the image
    [second] = cache.take_events()
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[1] and len(second.block_hashes) == 4
    assert not set(second.block_hashes) & set(first.block_hashes)
    assert cache.admit("c", prompt) == 2 * BS  # no image at all is a third prompt


def test_events_are_valid_on_the_wire_in_both_hash_kinds() -> None:
    for kind, check in (("bytes", lambda h: isinstance(h, bytes) and len(h) == 32), ("int", None)):
        cache = PagedPrefixCache(BS, 2, hash_kind=kind)  # type: ignore[arg-type]
        cache.admit("a", blocks(0, 2), [ImageSpan("i", 0, 1)])
        cache.release("a")
        cache.admit("b", blocks(100, 1))
        events = cache.take_events()
        for shape in ("map", "array"):
            payload = encode_batch(KVEventBatch(ts=0.0, events=events), shape=shape)  # type: ignore[arg-type]
            decoded = decode_batch(payload)
            assert not decoded.skipped and encode_batch(decoded.batch, shape=shape) == payload  # type: ignore[arg-type]
        hashes = [
            h for event in events if not isinstance(event, AllBlocksCleared) for h in event.block_hashes
        ]
        for block_hash in hashes:
            assert check(block_hash) if check else isinstance(block_hash, int) and 0 <= block_hash < 2**64


def test_the_map_wire_carries_every_vllm_field_in_order_and_shorter_frames_still_decode() -> None:
    """vLLM's own decoder requires lora_id, medium and lora_name (no defaults), so every field of its
    structs is written, in its order; what older engines send (fewer trailing fields) still decodes."""
    cache = PagedPrefixCache(BS, 2)
    cache.admit("a", blocks(0, 2), [ImageSpan("i", 0, 1)])
    cache.release("a")
    cache.admit("b", blocks(100, 1))  # evicts a block of "a"
    cache.release("b")
    cache.reset()
    events = cache.take_events()
    ts, raw, rank = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=0.5, events=events)))
    assert (ts, rank) == (0.5, None)  # positional: all three, always
    order = {"BlockStored": ["type", *STORED_FIELDS], "BlockRemoved": ["type", *REMOVED_FIELDS]}
    assert [list(event) for event in raw] == [order.get(event["type"], ["type"]) for event in raw]
    assert {event["type"] for event in raw} == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    plain = next(e for e in events if isinstance(e, BlockStored) and e.extra_keys is None)
    wire = raw[events.index(plain)]
    for count in range(4, len(STORED_FIELDS) + 1):  # the required four, then each optional one
        short = {"type": "BlockStored", **{name: wire[name] for name in STORED_FIELDS[:count]}}
        decoded = decode_batch(kv_wire.batch([short, kv_wire.removed([1]), kv_wire.cleared()]))
        cut = msgspec.structs.replace(plain, **dict.fromkeys(STORED_FIELDS[count:]))  # defaults: None
        removed = BlockRemoved(block_hashes=[1], medium="GPU")
        assert decoded.batch.events == [cut, removed, AllBlocksCleared()] and not decoded.skipped


def test_engine_hashes_depend_on_the_seed_and_the_kind_not_only_the_tokens() -> None:
    prompt = blocks(0, 2)
    kinds = [
        PagedPrefixCache(BS, 10).block_hashes(prompt),
        PagedPrefixCache(BS, 10, seed=b"other").block_hashes(prompt),
        PagedPrefixCache(BS, 10, hash_kind="int").block_hashes(prompt),
    ]
    assert kinds[0] != kinds[1] and all(isinstance(h, int) for h in kinds[2])
    cache = PagedPrefixCache(BS, 10)
    cache.admit("a", prompt)
    [stored] = cache.take_events()
    assert isinstance(stored, BlockStored) and stored.block_hashes == kinds[0]


def test_reset_is_refused_while_a_request_runs_and_clears_everything_after() -> None:
    cache = PagedPrefixCache(BS, 10)
    cache.admit("a", blocks(0, 2))
    assert cache.reset() is False
    cache.release("a")
    cache.take_events()
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()] and len(cache) == 0
    assert cache.admit("b", blocks(0, 2)) == 0


def test_request_ids_are_admitted_once_and_unknown_releases_are_ignored() -> None:
    cache = PagedPrefixCache(BS, 10)
    cache.admit("a", blocks(0, 1))
    with pytest.raises(ValueError, match="already admitted"):
        cache.admit("a", blocks(0, 1))
    cache.release("nope")
    with pytest.raises(ValueError, match="hash_kind"):
        PagedPrefixCache(BS, 10, hash_kind="str")  # type: ignore[arg-type]


def test_real_token_ids_of_a_shared_system_prompt_are_reused() -> None:
    tokenizer = Tokenizer.from_model_dir(DEMO_MODELS_DIR / "kimi-k3-demo")
    system = tokenizer.encode("You are a careful analyst. Answer concisely and cite figures. " * 8)
    cache = PagedPrefixCache(16, 100)
    cache.admit("a", [*system, *tokenizer.encode("Which quarter grew most?")])
    cache.release("a")
    reused = cache.admit("b", [*system, *tokenizer.encode("How is the weather in Berlin?")])
    assert reused == len(system) // 16 * 16 and reused > 0
