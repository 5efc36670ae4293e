"""The routing choice: affinity, the half-prompt balance rule, load, ties, temperature; the load tracker."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from dynamo_prep.engines.mock.kv_cache import PagedPrefixCache
from dynamo_prep.protocol.kv_events import ImageSpan
from dynamo_prep.routing import policy
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.policy import Decision, KvRouter, LoadTracker, count_blocks
from dynamo_prep.routing.settings import DEFAULT_KV_OVERLAP_SCORE_WEIGHT

WORKERS = ["w0", "w1", "w2"]


def choose(*args: Any, **kwargs: Any) -> Decision:
    """``policy.choose`` at Dynamo's weight (1: a block to prefill weighs a held one) unless told:
    the figures below are worked out at it; the default's own test is the last of this file."""
    return policy.choose(*args, **{"overlap_score_weight": 1.0, **kwargs})


def test_the_instance_holding_the_prefix_wins() -> None:
    decision = choose(WORKERS, {"w1": 8, "w2": 2}, 10, {}, {"w0": 0, "w1": 500, "w2": 10})
    assert decision == Decision("w1", overlap_blocks=8, prompt_blocks=10, cost=2.0, reason="overlap")


def test_load_outweighs_a_small_overlap_advantage() -> None:
    # w1 holds 8 of 10 blocks but is busy; w2 holds 6 and is idle: 2 + 30 > 4 + 2 x 2 (the 2 blocks
    # of w1's it would compute again, RECOMPUTE_WEIGHT) + 0
    decision = choose(WORKERS, {"w1": 8, "w2": 6}, 10, {"w1": 30}, {})
    assert (decision.instance_id, decision.cost, decision.reason) == ("w2", 8.0, "overlap")
    weighted = choose(WORKERS, {"w1": 8, "w2": 6}, 10, {"w1": 30}, {}, overlap_score_weight=20.0)
    assert weighted.instance_id == "w1"  # prefill weighs 20x: 40 + 30 beats 160
    cheap_prefill = choose(WORKERS, {"w1": 8, "w2": 6}, 10, {"w1": 3}, {}, overlap_score_weight=0.1)
    assert cheap_prefill.instance_id == "w2"  # 0.2 + 3 vs 0.8 + 0
    # A little load does not: w1 busy with 3 blocks, 2 + 3 < 8 + 0
    assert choose(WORKERS, {"w1": 8, "w2": 6}, 10, {"w1": 3}, {}).instance_id == "w1"


def test_a_new_prefix_goes_to_the_least_loaded_instance_not_the_one_holding_the_preamble() -> None:
    # w0 holds the shared 4-block system prompt of a 20-block conversation: less than half of it
    # (by cost alone w0 would win: 16 + 5 < 20 + 3)
    decision = choose(WORKERS, {"w0": 4}, 20, {"w0": 5, "w1": 5, "w2": 3}, {"w0": 100, "w1": 10, "w2": 10})
    assert decision.reason == "balance" and decision.instance_id == "w2"
    assert decision.overlap_blocks == 0 and decision.cost == 20 + 3
    # equal load: the instance holding fewer blocks gets the new prefix
    tied = choose(WORKERS, {"w0": 4}, 20, {}, {"w0": 100, "w1": 30, "w2": 10})
    assert tied.instance_id == "w2"
    # exactly half the prompt is affinity again
    assert choose(WORKERS, {"w0": 10}, 20, {}, {}).reason == "overlap"


def test_new_prefixes_spread_across_instances_as_load_builds_up() -> None:
    tracker = LoadTracker()
    chosen = []
    for n in range(6):
        active = {worker: tracker.active_blocks(worker) for worker in WORKERS}
        decision = choose(WORKERS, {"w0": 2}, 30, active, {"w0": 2})
        tracker.dispatch(f"r{n}", decision.instance_id, decision.prompt_blocks)
        chosen.append(decision.instance_id)
    assert Counter(chosen) == {"w0": 2, "w1": 2, "w2": 2}


def test_empty_and_unmatched_prompts_are_balanced() -> None:
    assert choose(WORKERS, {}, 0, {"w0": 1, "w1": 0, "w2": 1}, {}).instance_id == "w1"
    assert choose(WORKERS, {}, 3, {"w0": 1, "w1": 0, "w2": 1}, {}).reason == "balance"


def test_ties_go_to_fewer_blocks_held_then_rotate_with_the_turn() -> None:
    assert choose(WORKERS, {"w0": 5, "w1": 5}, 6, {}, {"w0": 9, "w1": 3}).instance_id == "w1"
    rotated = [choose(WORKERS, {}, 4, {}, {}, turn=turn).instance_id for turn in range(4)]
    assert rotated == ["w0", "w1", "w2", "w0"]
    # candidates are deduplicated and ordered by id, so the caller's order does not matter
    assert choose(["w2", "w0", "w2"], {}, 4, {}, {}, turn=1).instance_id == "w2"


def test_temperature_samples_a_softmax_over_normalised_costs() -> None:
    overlaps, prompt = {"w0": 10, "w1": 8, "w2": 6}, 10  # costs 0, 2, 4 -> normalised 0, 0.5, 1
    rng = random.Random(1234)
    draws = 30_000
    counts = Counter(
        choose(WORKERS, overlaps, prompt, {}, {}, temperature=1.0, rng=rng).instance_id for _ in range(draws)
    )
    weights = [math.exp(-x) for x in (0.0, 0.5, 1.0)]
    for worker, weight in zip(WORKERS, weights, strict=True):
        expected = draws * weight / sum(weights)
        assert abs(counts[worker] - expected) < 4 * math.sqrt(expected), (worker, counts)
    cold = Counter(
        choose(WORKERS, overlaps, prompt, {}, {}, temperature=0.05, rng=random.Random(5)).instance_id
        for _ in range(200)
    )
    assert cold["w0"] > 195  # a low temperature is nearly greedy
    same_seed = [
        choose(WORKERS, overlaps, prompt, {}, {}, temperature=1, rng=random.Random(9)) for _ in range(3)
    ]
    assert len(set(same_seed)) == 1


def test_temperature_does_not_apply_to_the_balance_rule() -> None:
    rng = random.Random(3)
    picks = {
        choose(WORKERS, {}, 8, {"w0": 4, "w2": 4}, {}, temperature=5.0, rng=rng).instance_id
        for _ in range(50)
    }
    assert picks == {"w1"}


def test_a_bigger_engine_takes_a_bigger_share_of_the_load() -> None:
    """Capacities from the cards (total_kv_blocks): the load terms are weighed by size."""
    active = {"w0": 100, "w1": 100}
    assert choose(["w0", "w1"], {}, 4, active, {}, capacity={"w0": 1000, "w1": 500}).instance_id == "w0"
    assert choose(["w0", "w1"], {}, 4, active, {}, capacity={"w0": 500, "w1": 1000}).instance_id == "w1"
    # Twice the size at 150 blocks is less loaded than half the size at 100 (150 < 100 * 2).
    busier = {"w0": 150, "w1": 100}
    assert choose(["w0", "w1"], {}, 4, busier, {}, capacity={"w0": 1000, "w1": 500}).instance_id == "w0"
    assert choose(["w0", "w1"], {}, 4, busier, {}).instance_id == "w1"  # without figures: alike
    # An instance whose card says nothing counts as the largest.
    assert choose(["w0", "w1"], {}, 4, active, {}, capacity={"w1": 500}).instance_id == "w0"


def test_an_instance_without_room_for_the_prompt_is_passed_over_while_another_has_room() -> None:
    # w0 holds 90 of the 100 prompt blocks and prefill weighs 20x: it wins by cost (200 + 950 against
    # 2000 + 10) unless its cache, full with running requests, has no room for the prompt.
    full = {"w0": 950, "w1": 10}
    pick = {"overlaps": {"w0": 90}, "prompt_blocks": 100, "blocks_held": {}, "overlap_score_weight": 20.0}
    sizes = {"w0": 1000, "w1": 1000}
    assert choose(["w0", "w1"], active_blocks=full, **pick).instance_id == "w0"  # no figures
    assert choose(["w0", "w1"], active_blocks=full, capacity=sizes, **pick).instance_id == "w1"
    # Nobody has room: the choice is made among all (the engines queue).
    crowded = {"w0": 950, "w1": 990}
    assert choose(["w0", "w1"], active_blocks=crowded, capacity=sizes, **pick).instance_id == "w0"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose([], {}, 1, {}, {})
    with pytest.raises(ValueError, match="temperature"):
        choose(WORKERS, {}, 1, {}, {}, temperature=-1)


def test_load_tracker_adds_at_dispatch_and_releases_once() -> None:
    tracker = LoadTracker()
    tracker.dispatch("a", "w0", 10)
    tracker.dispatch("b", "w0", 5)
    tracker.dispatch("c", "w1", 7)
    with pytest.raises(ValueError, match="already active"):
        tracker.dispatch("a", "w2", 1)
    assert tracker.active() == {"w0": 15, "w1": 7}
    tracker.release("a")
    tracker.release("a")
    tracker.release("unknown")
    assert tracker.active_blocks("w0") == 5
    tracker.forget("w0")
    tracker.release("b")  # its instance is gone: nothing to release
    assert tracker.active() == {"w1": 7}
    tracker.release("c")
    assert tracker.active() == {}


def test_load_counts_each_shared_block_once_per_instance() -> None:
    """Two running requests on one instance that share a 3-block prefix hold 3 + 2 + 1 distinct
    blocks, plus a partial last block each; the shared ones stay until the last holder ends."""
    tracker = LoadTracker()
    tracker.dispatch("a", "w0", 5, [1, 2, 3, 4])
    tracker.dispatch("b", "w0", 6, [1, 2, 3, 5, 6])
    tracker.dispatch("c", "w1", 4, [1, 2, 3, 7])
    assert tracker.active() == {"w0": 6 + 2, "w1": 4}
    tracker.release("a")
    assert tracker.active_blocks("w0") == 5 + 1
    tracker.release("b")
    assert tracker.active() == {"w1": 4}


def test_blocks_waiting_for_prefill_count_until_the_first_token() -> None:
    """An instance busy prefilling another request is as far from this one's first token as the
    blocks it still has to prefill; once that request's first token is out, it is not."""
    tracker = LoadTracker()
    tracker.dispatch("long", "w0", 50, list(range(50)), prefill_blocks=50)
    tracker.dispatch("other", "w1", 30, list(range(100, 130)), prefill_blocks=30)
    tracker.prefilled("other")
    assert tracker.prefilling() == {"w0": 50, "w1": 0} and tracker.active() == {"w0": 50, "w1": 30}
    # 20 of 24 blocks cached on w0, none on w1: w0 would win on overlap (4 + 50 vs 24 + 2 x 20 + 30,
    # the 20 held by w0 computed again)...
    busy = choose(["w0", "w1"], {"w0": 20}, 24, tracker.active(), {}, prefilling=tracker.prefilling())
    assert busy.instance_id == "w1"  # ...but it has 50 blocks to prefill first: 54 + 50 vs 64 + 30
    tracker.prefilled("long")
    tracker.prefilled("long")  # once only
    assert tracker.prefilling() == {"w0": 0, "w1": 0}
    free = choose(["w0", "w1"], {"w0": 20}, 24, tracker.active(), {}, prefilling=tracker.prefilling())
    assert free.instance_id == "w0"
    tracker.release("long")
    tracker.release("other")
    assert tracker.prefilling() == {} and tracker.active() == {}


def test_count_blocks_counts_a_partial_block() -> None:
    assert [count_blocks(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_router_hashes_matches_chooses_and_tracks_load_end_to_end() -> None:
    """Two mock engines publish into one index; the router follows the cached prefix, balances new
    prefixes, and an image changes what is cached."""
    index = KvIndex(4)
    caches = {
        name: PagedPrefixCache(4, 1000, hash_kind=kind) for name, kind in (("a", "int"), ("b", "bytes"))
    }
    router = KvRouter(index, seed=0)

    def serve(request_id: str, prompt: list[int], images: list[ImageSpan] | None = None) -> Decision:
        decision = router.decide(sorted(caches), prompt, images or [])
        router.dispatch(request_id, decision)
        cache = caches[decision.instance_id]
        cache.admit(request_id, prompt, images or [])
        index.apply(decision.instance_id, cache.take_events())
        return decision

    def finish(request_id: str) -> None:
        router.release(request_id)
        for cache in caches.values():
            cache.release(request_id)

    system = list(range(1000, 1040))  # 10 blocks
    first = serve("r1", [*system, *range(1, 9)])
    assert first.reason == "balance"
    finish("r1")
    second = serve("r2", [*system, *range(50, 58)])  # 10 of 12 blocks cached on the first instance
    assert (second.instance_id, second.overlap_blocks, second.reason) == (first.instance_id, 10, "overlap")
    other = serve("r3", list(range(5000, 5048)))  # a new prefix goes to the idle instance
    assert other.instance_id != first.instance_id and other.reason == "balance"
    assert router.load.active_blocks(first.instance_id) == 12
    finish("r2")
    finish("r3")
    assert router.load.active() == {}
    pictured = serve("r4", [*system, *range(1, 9)], [ImageSpan("sha256:chart", 36, 6)])
    assert pictured.instance_id == first.instance_id and pictured.overlap_blocks == 9


def test_what_a_request_shares_with_an_instances_running_requests_is_not_load_it_adds_there() -> None:
    """w0 is prefilling a 50-block prompt whose first 24 blocks are this request's whole prompt: the
    request would wait for those blocks there, or compute them itself elsewhere. Counted as load
    (Dynamo's cost) w1 wins, 0 + 50 + 50 against 24 + 2 x 24 (computed again); shared, w0 does:
    26 + 26."""
    tracker = LoadTracker()
    tracker.dispatch("long", "w0", 50, list(range(49)), prefill_blocks=50)
    prompt = list(range(24))
    assert tracker.shared("w0", prompt) == (24, 24) and tracker.shared("w1", prompt) == (0, 0)
    assert tracker.shared("w0", [99, *prompt]) == (0, 0)  # a chain from its first block only
    figures = {"active_blocks": tracker.active(), "blocks_held": {}, "prefilling": tracker.prefilling()}
    assert choose(["w0", "w1"], {"w0": 24}, 24, **figures).instance_id == "w1"  # type: ignore[arg-type]
    shared = {"w0": tracker.shared("w0", prompt)}
    decision = choose(["w0", "w1"], {"w0": 24}, 24, shared=shared, **figures)  # type: ignore[arg-type]
    assert (decision.instance_id, decision.cost) == ("w0", 0 + 26 + 26)
    # Once it had its first token, the 24 blocks are shared as active blocks only.
    tracker.prefilled("long")
    assert tracker.shared("w0", prompt) == (24, 0) and tracker.shared("w0", prompt[:5]) == (5, 0)
    tracker.dispatch("short", "w0", 3, [0, 1, 77], prefill_blocks=1)  # only 77 is its own to prefill
    assert tracker.shared("w0", prompt) == (24, 0) and tracker.shared("w0", [0, 1, 77]) == (3, 1)


def test_by_default_a_prefix_stays_where_it_is_cached_when_that_instance_runs_three_prompts_more() -> None:
    """The default weight (2): two engines, 50-block prompts of which 47 blocks are a cached prefix
    on w0, which runs three more prompts' worth of blocks than w1 (150): at Dynamo's weight 1 the
    request leaves for w1 and computes the prefix again there (150 > 3 + 141), at 2 it stays."""
    assert DEFAULT_KV_OVERLAP_SCORE_WEIGHT == 2.0
    arguments = (["w0", "w1"], {"w0": 47}, 50, {"w0": 150}, {"w0": 47})
    assert choose(*arguments).instance_id == "w1"  # weight 1
    assert policy.choose(*arguments).instance_id == "w0"
    # a heavier imbalance still spreads: w0 runs six prompts more
    assert policy.choose(["w0", "w1"], {"w0": 47}, 50, {"w0": 300}, {"w0": 47}).instance_id == "w1"
