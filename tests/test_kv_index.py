"""KvIndex: events from the mock engine's cache and by hand, several instances, refusals."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.logging import RateLimiter
from dynamo_prep.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ImageSpan,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex

BS = 4
PROMPT = list(range(100, 140))  # 10 blocks
IMAGES = [ImageSpan("img-1", 6, 5)]


def stored(hashes: list[object], parent: object, tokens: list[int], **fields: object) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, **fields
    )  # type: ignore[arg-type]


def wire(events: list[KVEvent], shape: str = "map") -> list[KVEvent]:
    """The events as a subscriber hands them over: encoded by the engine, decoded by the frontend."""
    decoded = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=events), shape=shape))  # type: ignore[arg-type]
    assert not decoded.skipped
    return decoded.batch.events


def own(tokens: list[int], images: list[ImageSpan] | None = None) -> list[int]:
    return request_block_hashes(tokens, BS, images or [])


def test_two_instances_with_different_engine_hash_kinds_holding_the_same_prefix_both_match() -> None:
    index = KvIndex(BS)
    as_int = PagedPrefixCache(BS, 64, hash_kind="int")
    as_bytes = PagedPrefixCache(BS, 64, hash_kind="bytes", seed=b"another engine")
    as_int.admit("r", PROMPT, IMAGES)
    as_bytes.admit("r", PROMPT[:24], IMAGES)
    index.apply("w-int", wire(as_int.take_events(), "array"))
    index.apply("w-bytes", wire(as_bytes.take_events(), "map"))
    assert index.match(own(PROMPT, IMAGES)) == {"w-int": 10, "w-bytes": 6}
    assert index.match(own(PROMPT)) == {"w-int": 1, "w-bytes": 1}  # the image starts in block 1
    assert index.blocks_held("w-int") == 10 and index.blocks_held("w-bytes") == 6
    assert len(index) == 10  # six blocks are shared
    assert index.counters.stored_blocks == 16


def test_stores_chain_to_known_parents_and_extend_the_prefix() -> None:
    index = KvIndex(BS)
    index.apply("a", [stored([b"h0", b"h1"], None, PROMPT[:8])])
    index.apply("a", [stored([b"h2"], b"h1", PROMPT[8:12]), stored([b"h3", b"h4"], b"h2", PROMPT[12:20])])
    assert index.match(own(PROMPT)) == {"a": 5}
    assert index.match(own(PROMPT[:10])) == {"a": 2}  # a partial block is never matched
    assert index.match(own([1, 2, 3, 4, *PROMPT])) == {}
    assert index.match([]) == {}


def test_an_unknown_parent_is_refused_and_never_touches_another_instance() -> None:
    index = KvIndex(BS)
    index.apply("b", [stored([7, 8], None, PROMPT[:8])])
    # instance "a" names b's engine hash 8 as its parent: engine hashes mean nothing across instances
    index.apply("a", [stored([9], 8, PROMPT[8:12]), stored([10], 9, PROMPT[12:16])])
    assert index.counters.unknown_parent_blocks == 2
    assert index.blocks_held("a") == 0
    assert index.match(own(PROMPT)) == {"b": 2}
    index.apply("b", [stored([11], 8, PROMPT[8:12])])
    assert index.match(own(PROMPT)) == {"b": 3}


def test_removals_cut_the_prefix_and_unknown_removals_are_counted() -> None:
    index = KvIndex(BS)
    index.apply("a", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    index.apply("b", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    index.apply("a", [BlockRemoved(block_hashes=[4, 3, 99])])  # tail first, as engines evict
    assert index.match(own(PROMPT)) == {"a": 2, "b": 4}
    assert index.blocks_held("a") == 2
    assert index.counters.removed_blocks == 2 and index.counters.unknown_removed_blocks == 1
    index.apply("b", [BlockRemoved(block_hashes=[4, 3, 2, 1])])
    assert index.match(own(PROMPT)) == {"a": 2}
    assert index.counters.orphaned_blocks == 0


def test_a_block_removed_before_its_descendants_takes_them_along() -> None:
    """No engine evicts a parent before its children; if one did, the children could never be
    reached by a prefix match again, so the index drops them (and forgets their engine hashes)."""
    index = KvIndex(BS)
    index.apply("a", [stored([1, 2, 3, 4], None, PROMPT[:16]), stored([5], 2, [0, 0, 0, 0])])
    index.apply("b", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    index.apply("a", [BlockRemoved(block_hashes=[2])])
    assert index.counters.orphaned_blocks == 3 and index.blocks_held("a") == 1
    assert index.match(own(PROMPT)) == {"a": 1, "b": 4}
    index.apply("a", [BlockRemoved(block_hashes=[3]), stored([6], 4, PROMPT[16:20])])
    assert index.counters.unknown_removed_blocks == 1 and index.counters.unknown_parent_blocks == 1
    index.apply("a", [stored([2, 3], 1, PROMPT[4:12])])  # stored again, it chains as before
    assert index.match(own(PROMPT)) == {"a": 3, "b": 4}
    assert len(index) == 4


def test_all_blocks_cleared_and_reset_forget_one_instance_only() -> None:
    index = KvIndex(BS)
    for name in ("a", "b", "c"):
        index.apply(name, [stored([1, 2], None, PROMPT[:8])])
    index.apply("a", [AllBlocksCleared()])
    index.reset("b")
    assert index.match(own(PROMPT)) == {"c": 2}
    assert index.counters.cleared == 1 and index.counters.resets == 1
    assert [index.blocks_held(name) for name in ("a", "b", "c")] == [0, 0, 2]
    assert index.held() == {"a": 0, "c": 2} and index.held().get("b", 0) == 0
    assert sorted(index.instances()) == ["a", "c"]
    # a new instance takes b's freed bit and inherits nothing from it
    index.apply("d", [stored([5], None, PROMPT[:4])])
    assert index.match(own(PROMPT)) == {"c": 2, "d": 1}
    index.apply("a", [stored([1, 2], None, PROMPT[:8])])  # a cleared instance refills from scratch
    assert index.match(own(PROMPT)) == {"a": 2, "c": 2, "d": 1}
    index.reset("never-seen")


class Counted(list[int]):
    """A request's hashes that count how many the index looks at."""

    looked = 0

    def __getitem__(self, index: object) -> int:  # type: ignore[override]
        self.looked += 1
        return super().__getitem__(index)  # type: ignore[index,no-any-return]


def test_match_looks_at_a_few_blocks_not_all_of_them() -> None:
    index = KvIndex(BS)
    prompt = list(range(1024 * BS))
    index.apply("a", [stored(list(range(700)), None, prompt[: 700 * BS])])
    index.apply("b", [stored(list(range(300)), None, prompt[: 300 * BS])])
    index.apply("c", [stored(list(range(1024)), None, prompt)])
    hashes = Counted(own(prompt))
    assert index.match(hashes) == {"a": 700, "b": 300, "c": 1024}
    assert hashes.looked <= 2 + 2 * 10  # the ends, then about log2(1024) per run ending inside
    nobody = Counted(own([7, *prompt]))
    assert index.match(nobody) == {} and nobody.looked == 1
    assert index.match(Counted()) == {}


@pytest.mark.parametrize("seed", range(5))
def test_match_agrees_with_a_walk_block_by_block(seed: int) -> None:
    rng = random.Random(seed)
    index = KvIndex(BS)
    prompt = [rng.randrange(1000) for _ in range(200 * BS)]
    for number in range(10):
        held = rng.randrange(200)
        if held:
            index.apply(f"w{number}", [stored(list(range(held)), None, prompt[: held * BS])])
    hashes = own(prompt)
    walked = {}
    for name in index.instances():
        depth = 0
        while depth < len(hashes) and index.match(hashes[: depth + 1]).get(name) == depth + 1:
            depth += 1
        if depth:
            walked[name] = depth
    assert index.match(hashes) == walked


def test_invalid_events_are_counted_and_leave_state_intact() -> None:
    index = KvIndex(BS)
    index.apply("a", [stored([1], None, PROMPT[:4])])
    index.apply(
        "a",
        [
            BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=PROMPT[4:12], block_size=8),
            stored([2], 1, PROMPT[4:7]),  # not a whole block
            stored([2], 1, PROMPT[4:8], extra_keys=[[object()]]),  # an extra key that cannot be hashed
            BlockRemoved(block_hashes=[[1]]),  # type: ignore[list-item]  # unhashable
        ],
    )
    assert index.counters.invalid_events == 4
    assert index.match(own(PROMPT)) == {"a": 1}


def test_an_engine_hash_reused_for_other_content_moves_the_block() -> None:
    index = KvIndex(BS)
    index.apply("a", [stored([1, 2], None, PROMPT[:8])])
    index.apply("a", [stored([2], 1, [0, 0, 0, 0])])  # hash 2 now stands for other tokens
    assert index.match(own(PROMPT)) == {"a": 1}
    assert index.match(own([*PROMPT[:4], 0, 0, 0, 0])) == {"a": 2}
    assert index.blocks_held("a") == 2
    index.apply("a", [stored([1, 2], None, PROMPT[:8])] * 2)  # replayed twice: idempotent
    assert index.blocks_held("a") == 2 and index.match(own(PROMPT)) == {"a": 2}


def test_two_engine_hashes_for_one_block_keep_it_until_both_are_removed() -> None:
    index = KvIndex(BS)
    index.apply("a", [stored([1], None, PROMPT[:4]), stored([b"x"], None, PROMPT[:4])])
    assert index.blocks_held("a") == 1
    index.apply("a", [BlockRemoved(block_hashes=[1])])
    assert index.match(own(PROMPT)) == {"a": 1}
    index.apply("a", [BlockRemoved(block_hashes=[b"x"])])
    assert index.match(own(PROMPT)) == {} and len(index) == 0


def test_the_index_follows_a_busy_cache_exactly() -> None:
    """Random traffic with eviction: after every step the index holds what the cache holds, and a
    prompt's match is what the cache would reuse."""
    rng = random.Random(7)
    cache = PagedPrefixCache(BS, 40, hash_kind="int")
    index = KvIndex(BS)
    preambles = [[rng.randrange(50_000) for _ in range(12)] for _ in range(3)]
    running: list[tuple[str, list[int]]] = []
    for step in range(300):
        if running and (len(running) > 3 or rng.random() < 0.5):
            request_id, _ = running.pop(rng.randrange(len(running)))
            cache.release(request_id, [rng.randrange(50_000) for _ in range(rng.randrange(10))])
        else:
            prompt = rng.choice(preambles) + [rng.randrange(50_000) for _ in range(rng.randrange(30))]
            images = [ImageSpan(f"img{rng.randrange(2)}", 10, 6)] if rng.random() < 0.3 else []
            expected = index.match(own(prompt, images)).get("w", 0)
            assert cache.admit(f"r{step}", prompt, images) == min(expected, (len(prompt) - 1) // BS) * BS
            running.append((f"r{step}", prompt))
        index.apply("w", wire(cache.take_events()))
        assert index.blocks_held("w") == len(cache)
    assert index.counters.removed_blocks > 0
    assert index.counters.unknown_parent_blocks == index.counters.unknown_removed_blocks == 0


def test_refusals_are_logged_rate_limited() -> None:
    index = KvIndex(BS, limiter=RateLimiter(interval_s=3600))
    with capture_logs() as logs:
        for _ in range(5):
            index.apply("a", [stored([2], 1, PROMPT[:4])])
    assert [entry["event"] for entry in logs] == ["kv_event_refused"]
    assert logs[0]["reason"] == "unknown_parent" and logs[0]["instance_id"] == "a"
    assert index.counters.unknown_parent_blocks == 5


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KvIndex(0)


ENGINE_HASHES = st.sampled_from([0, 1, 2, 3, 2**64 - 1, b"a", b"b", b"\x00" * 32])
GARBAGE = st.one_of(
    st.builds(
        lambda hashes, parent, token, block_size, keys: BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[token] * (len(hashes) * block_size),
            block_size=block_size,
            extra_keys=keys,
        ),
        st.lists(ENGINE_HASHES, min_size=1, max_size=3),
        st.one_of(st.none(), ENGINE_HASHES),
        st.integers(0, 3),
        st.sampled_from([BS, BS, 2]),
        st.one_of(st.none(), st.just([["img", 0]] * 3), st.just([[]])),
    ),
    st.builds(lambda hashes: BlockRemoved(block_hashes=hashes), st.lists(ENGINE_HASHES, max_size=3)),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(garbage=st.lists(st.lists(GARBAGE, max_size=4), max_size=12), seed=st.integers(0, 3))
def test_garbage_on_one_instance_never_changes_another(garbage: list[list[KVEvent]], seed: int) -> None:
    """Instance "bad" sends arbitrary stores (unknown parents, reused hashes, other block sizes),
    removals and clears, interleaved with instance "good"'s real events: "good" matches exactly as
    in an index that never saw "bad"."""
    rng = random.Random(seed)
    cache = PagedPrefixCache(BS, 12, hash_kind="int")
    mixed, alone = KvIndex(BS), KvIndex(BS)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(4, 24))] for _ in range(len(garbage))]
    for number, (events, prompt) in enumerate(zip(garbage, prompts, strict=True)):
        cache.admit(str(number), prompt)
        cache.release(str(number), [1, 2, 3])
        good = cache.take_events()
        mixed.apply("bad", events)
        mixed.apply("good", good)
        alone.apply("good", good)
    for prompt in prompts:
        hashes = own(prompt)
        assert mixed.match(hashes).get("good") == alone.match(hashes).get("good")
        depth = mixed.match(hashes).get("bad", 0)
        assert all(mixed.match(hashes[: d + 1]).get("bad") == d + 1 for d in range(depth))
    assert mixed.blocks_held("good") == alone.blocks_held("good") == len(cache)
    mixed.reset("good")
    mixed.reset("bad")
    assert len(mixed) == 0
