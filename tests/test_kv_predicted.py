"""Predicted blocks: a routed request's prompt counts as cached on its instance (``KvIndex.predict``,
through ``KvRouter.dispatch``) until the engine's own events speak of it, or a short time after the
request's first token; concurrent requests of a new prefix then follow the first one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dynamo_prep.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.policy import Decision, KvRouter
from dynamo_prep.routing.predicted import PredictedBlocks

BS = 4
PREFIX = list(range(1000, 1040))  # 10 blocks
OTHER = list(range(5000, 5040))
INSTANCES = ["a", "b"]


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(prefix: list[int], tail: int) -> list[int]:
    return [*prefix, *range(tail * 100, tail * 100 + 8)]  # 2 more blocks of its own


def own(tokens: list[int]) -> list[int]:
    return request_block_hashes(tokens, BS)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS)  # type: ignore[arg-type]


def serve(router: KvRouter, request_id: str, tokens: list[int]) -> Decision:
    decision = router.decide(INSTANCES, tokens)
    router.dispatch(request_id, decision)
    return decision


@pytest.mark.parametrize("ttl", [2.0, 0.0])
def test_concurrent_requests_of_a_new_prefix_follow_the_first_and_other_prefixes_spread(ttl: float) -> None:
    """Nothing has reached the index from the engines yet (the first request is still prefilling)."""
    router = KvRouter(KvIndex(BS, predict_ttl_s=ttl, clock=Clock()))
    first = serve(router, "p1", prompt(PREFIX, 1))
    assert first.reason == "balance" and first.overlap_blocks == 0
    followers = [serve(router, f"p{n}", prompt(PREFIX, n)) for n in (2, 3)]
    other = serve(router, "q1", prompt(OTHER, 1))
    assert other.instance_id != first.instance_id and other.reason == "balance"
    if not ttl:  # without predictions (the old router) the second copy of the prefix spreads
        assert followers[0].instance_id != first.instance_id
        return
    assert [(d.instance_id, d.overlap_blocks, d.reason) for d in followers] == [
        (first.instance_id, 10, "overlap")
    ] * 2
    again = serve(router, "q2", prompt(OTHER, 2))  # the other prefix follows its own first request
    assert (again.instance_id, again.overlap_blocks) == (other.instance_id, 10)


def test_the_engines_events_replace_predictions_and_a_removal_wins() -> None:
    index = KvIndex(BS, predict_ttl_s=60.0, clock=Clock())
    hashes = own(prompt(PREFIX, 1))
    predicted = index.predict("a", hashes)  # the request is pinning them (no first token yet)
    assert len(predicted) == 12 and index.match(hashes) == {"a": 12}
    # The engine stores the first 4 blocks: its word replaces those predictions.
    index.apply("a", [stored([1, 2, 3, 4], None, PREFIX[:16])])
    assert index.predicted.count() == 8 and index.match(hashes) == {"a": 12}
    assert index.match_cached(hashes) == {"a": 4}
    # It evicts them while the request still pins the rest: the run is cut where the engine says.
    index.apply("a", [BlockRemoved(block_hashes=[4, 3, 2, 1])])
    assert index.match(hashes) == {}
    # A prediction made while the engine holds part of the prompt covers only what follows.
    index.apply("b", [stored([7, 8], None, PREFIX[:8])])
    assert list(index.predict("b", hashes)) == hashes[2:]
    index.apply("b", [BlockRemoved(block_hashes=[8])])
    assert index.match(hashes) == {"b": 1}
    # A cleared cache, a reset and an instance that left take every prediction of theirs along.
    index.predict("c", hashes)
    index.apply("b", [AllBlocksCleared()])
    index.reset("a")
    assert index.match(hashes) == {"c": 12}
    index.forget("c")
    assert index.match(hashes) == {} and index.predicted.count() == 0
    index.unpredict("a", predicted)  # the request ends after all: nothing to unpin


def test_predictions_hold_until_the_first_token_then_expire_after_their_ttl() -> None:
    clock = Clock()
    index = KvIndex(BS, predict_ttl_s=2.0, clock=clock)
    router = KvRouter(index)
    hashes = own(prompt(PREFIX, 1))
    first = serve(router, "r1", prompt(PREFIX, 1))
    clock.now += 100  # a long wait in the engine's queue: the request still pins them
    assert index.match(hashes) == {first.instance_id: 12}
    router.prefilled("r1")
    clock.now += 1.5
    assert index.match(hashes) == {first.instance_id: 12}
    # A second request of the prefix pins them again (by the prediction, no events yet)...
    second = serve(router, "r2", prompt(PREFIX, 2))
    assert second.instance_id == first.instance_id
    clock.now += 1.0
    assert index.match(hashes) == {first.instance_id: 10}  # r1's own 2 blocks expired, r2 pins 10
    router.release("r2")  # ...and one ended before its first token starts the time-to-live too
    router.release("r1")
    clock.now += 2.0
    assert index.match(hashes) == {} and index.predicted.count() == 0


def test_an_instance_predicts_at_most_its_capacity_and_ttl_zero_predicts_nothing() -> None:
    index = KvIndex(BS, predict_ttl_s=1.0, clock=Clock())
    index.set_capacity("a", 4)
    hashes = own(prompt(PREFIX, 1))
    assert len(index.predict("a", hashes)) == 4 and index.match(hashes) == {"a": 4}
    assert not index.predict("a", own(prompt(OTHER, 1)))  # full: nothing more
    off = KvIndex(BS)
    assert not off.predict("a", hashes) and off.match(hashes) == {}
    with pytest.raises(ValueError, match="time-to-live"):
        PredictedBlocks(-1.0)
