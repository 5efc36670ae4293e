"""Where a request goes: the cost of each instance, the choice, and the load the choice adds.

Cost per instance (Dynamo's): ``overlap_score_weight * (prompt_blocks - overlap + prefilling) +
active_blocks``: the blocks it would have to prefill before this request's first token (this
request's uncached blocks and those of the requests it was sent that have not had their first
token yet) plus the blocks its running requests hold. At
temperature 0 the cheapest instance wins; above 0 one is sampled from a softmax over the costs
normalised to [0, 1] (``exp(-normalised / temperature)``), so a higher temperature spreads more.

Beyond Dynamo, computing a prefix again costs more than its prefill: by cost, an instance also pays
``RECOMPUTE_WEIGHT`` (2) times its prefill weight for each block it would compute that the instance
with the most of them already holds (``best overlap - overlap``). A request leaves the instance
holding its prefix only when waiting there would cost more than that: the same prefix computed on
several instances is compute and cache spent on no new token, and spreads the next requests of it
too. (With it counted once, 3 of 24 requests of ``vllm bench serve``'s prefix_repetition left their
prefix's instance when it ran 6 of the 8 streams; counted twice, none did.)

Beyond Dynamo, the balance rule: when no instance holds at least half the prompt
(``2 * max overlap < prompt_blocks``), the request goes to the least loaded instance (fewest active
and prefilling blocks, then fewest blocks held) whatever the temperature. A new prefix then lands where there
is room instead of piling onto whichever instance holds a shared preamble (a system prompt, tool
declarations), which would otherwise win every new conversation by a few blocks.

Capacity (each instance's ``total_kv_blocks``, its engine's own figure from its card): an instance
whose active and prefilling blocks leave no room for this prompt is passed over while another has
room, and among instances of different sizes the load terms are weighed by size (the largest
counts its blocks as they are; one half as large counts each block twice), so a bigger engine
takes a proportionally bigger share. Without capacities every instance counts alike.

Shared work: what a request shares with an instance's running requests is not load it adds
there. The leading blocks of its prompt that they hold count against neither the active term nor
the room check, and those of them still waiting to be prefilled (another request of the same prefix
is computing them) not against the prefill term: the request needs them computed anyway, there or
elsewhere. With the prediction of a routed request's blocks (``KvIndex.predict``), concurrent
requests of a new prefix thus follow the first one instead of computing it again elsewhere, while
different prefixes still spread by load.

Ties (equal cost, or equal load in the balance rule) go to the instance holding fewer blocks,
then to a round-robin turn over the candidates in id order: with equal figures (a cold start,
all idle) consecutive requests still spread instead of always landing on the lowest id.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from dynamo_prep.protocol.kv_events import ImageSpan
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex
from dynamo_prep.routing.settings import DEFAULT_KV_OVERLAP_SCORE_WEIGHT, DEFAULT_ROUTER_TEMPERATURE

__all__ = [
    "Decision",
    "KvRouter",
    "LoadTracker",
    "Reason",
    "choose",
    "count_blocks",
]

# Blocks another instance holds, computed again, cost this many times their prefill on top of it:
# the work buys no new token, and the prefix then takes cache room on two instances.
RECOMPUTE_WEIGHT: Final = 2

Reason = Literal["overlap", "balance"]


@dataclass(frozen=True, slots=True)
class Decision:
    """One routing choice and the figures it was made on.

    ``reason``: ``"overlap"`` (chosen by cost) or ``"balance"`` (no instance held half the prompt);
    ``cost`` is the chosen instance's cost either way.
    """

    instance_id: str
    overlap_blocks: int
    prompt_blocks: int
    cost: float
    reason: Reason
    block_hashes: Sequence[int] = ()  # the prompt's full blocks as the chosen instance caches them


def count_blocks(token_count: int, block_size: int) -> int:
    """Blocks a prompt occupies on an engine (a partial last block counts: it is prefilled too)."""
    return -(-token_count // block_size)


def choose(
    candidates: Sequence[str],
    overlaps: Mapping[str, int],
    prompt_blocks: int,
    active_blocks: Mapping[str, int],
    blocks_held: Mapping[str, int],
    *,
    overlap_score_weight: float = DEFAULT_KV_OVERLAP_SCORE_WEIGHT,
    temperature: float = DEFAULT_ROUTER_TEMPERATURE,
    rng: random.Random | None = None,
    turn: int = 0,
    prefilling: Mapping[str, int] | None = None,
    capacity: Mapping[str, int] | None = None,
    shared: Mapping[str, tuple[int, int]] | None = None,
) -> Decision:
    """The instance for a request of ``prompt_blocks`` blocks (see the module docstring).

    ``prefilling``: blocks each instance still has to prefill for requests it was sent (they delay
    this one's first token there, as its own prefill does). ``capacity``: each instance's KV blocks
    (missing: unbounded, weighed as the largest). ``shared``: per instance, how many of its active
    blocks and of its prefilling blocks are this prompt's (``LoadTracker.shared``). Missing entries
    in the other mappings count as 0. ``rng`` is only drawn from when ``temperature > 0`` and the
    cost rule applies; ``turn`` rotates the final tie-break.
    """
    if not candidates:
        raise ValueError("no candidate instance")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    # Each figure read once per candidate, from plain dicts of the instances that have one: a
    # decision among 2,000 instances took 7 ms of Mapping lookups.
    queued = _present(prefilling or {})
    active = _present(active_blocks)
    for instance_id, (shared_active, shared_prefill) in (shared or {}).items():
        active[instance_id] = max(active.get(instance_id, 0) - shared_active, 0)
        queued[instance_id] = max(queued.get(instance_id, 0) - shared_prefill, 0)
    sizes = capacity or {}
    ordered = _with_room(sorted(set(candidates)), prompt_blocks, active, queued, sizes)
    weight = _weights(ordered, sizes)
    found = [overlaps.get(instance_id, 0) for instance_id in ordered]
    best_overlap = max(found)
    balance = not best_overlap or 2 * best_overlap < prompt_blocks
    waiting = [queued.get(instance_id, 0) for instance_id in ordered]
    weighted = [active.get(instance_id, 0) * weight[instance_id] for instance_id in ordered]
    # By cost, an instance also pays for the blocks it would compute again that another one holds.
    again = 0 if balance else best_overlap
    costs = [
        overlap_score_weight * (prompt_blocks - overlap + wait + RECOMPUTE_WEIGHT * (again - overlap)) + held
        for overlap, wait, held in zip(found, waiting, weighted, strict=True)
    ]
    if not balance and temperature > 0:
        index = _sample(costs, temperature, rng or random.Random())
    else:
        load = [held + wait * weight[i] for held, wait, i in zip(weighted, waiting, ordered, strict=True)]
        primary = load if balance else costs
        index = _least(primary, ordered, blocks_held, turn)
    chosen = ordered[index]
    reason: Reason = "balance" if balance else "overlap"
    return Decision(chosen, overlaps.get(chosen, 0), prompt_blocks, costs[index], reason)


def _present(figures: Mapping[str, int]) -> dict[str, int]:
    """``figures`` as a dict of its non-zero entries (a live view has few: the busy instances)."""
    return {key: value for key, value in figures.items() if value}


def _with_room(
    ordered: list[str],
    prompt_blocks: int,
    active: Mapping[str, int],
    queued: Mapping[str, int],
    capacity: Mapping[str, int],
) -> list[str]:
    """The instances with room for the prompt in their KV cache, or all when none has (the engines
    queue it)."""
    if not capacity:
        return ordered
    roomy = [
        i
        for i in ordered
        if i not in capacity or active.get(i, 0) + queued.get(i, 0) + prompt_blocks <= capacity[i]
    ]
    return roomy or ordered


def _weights(ordered: list[str], capacity: Mapping[str, int]) -> dict[str, float]:
    """Each instance's weight on its load: the largest capacity over its own (1 without figures)."""
    get = capacity.get
    largest = max((size for i in ordered if (size := get(i))), default=0)
    return {i: largest / size if (size := get(i)) else 1.0 for i in ordered}


def _least(primary: Sequence[float], ordered: list[str], blocks_held: Mapping[str, int], turn: int) -> int:
    """Index of the least ``primary``; ties to fewer blocks held, then to the round-robin turn."""
    lowest = min(primary)
    if primary.count(lowest) == 1:
        return primary.index(lowest)
    start = turn % len(ordered)
    tied = [i for i, value in enumerate(primary) if value == lowest]
    get = blocks_held.get
    held = [get(ordered[i], 0) for i in tied]
    fewest = min(held)
    tied = [i for i, count in zip(tied, held, strict=True) if count == fewest]  # in index order
    return next((i for i in tied if i >= start), tied[0])  # the first from the turn on, cyclically


def _sample(costs: list[float], temperature: float, rng: random.Random) -> int:
    low, high = min(costs), max(costs)
    if high == low:
        return rng.randrange(len(costs))
    weights = [math.exp(-(value - low) / (high - low) / temperature) for value in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]


class LoadTracker:
    """What each instance is busy with, from dispatch until the request ends.

    Active blocks are counted as Dynamo counts them: each distinct full block of the running
    requests' prompts once per instance (requests sharing a prefix there share its blocks), plus
    every block given without a hash (a partial last block). Prefilling blocks are the uncached
    blocks of the requests that have not had their first token yet (``prefilled`` ends that),
    counted per request (each computes its own), and known by hash for ``shared``.
    Generated tokens are not counted (their number is unknown at dispatch and small next to the
    prompts this router is for).
    """

    def __init__(self) -> None:
        self._instances: dict[str, _Load] = {}
        self._requests: dict[str, _Request] = {}

    def dispatch(
        self,
        request_id: str,
        instance_id: str,
        blocks: int,
        block_hashes: Sequence[int] = (),
        prefill_blocks: int = 0,
    ) -> None:
        """``request_id`` now holds ``blocks`` blocks on ``instance_id``, the first of them named by
        ``block_hashes`` (a chain: equal hashes are the same prefix), and has ``prefill_blocks`` of
        them to prefill; a request id may be active once."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        prefill = max(prefill_blocks, 0)
        request = _Request(
            instance_id,
            block_hashes,
            max(blocks - len(block_hashes), 0),
            prefill,
            block_hashes[max(blocks - prefill, 0) :] if prefill else (),  # the uncached ones
        )
        self._requests[request_id] = request
        load = self._instances.get(instance_id)
        if load is None:
            load = self._instances[instance_id] = _Load()
        load.refs.update(block_hashes)
        load.prefill_refs.update(request.prefill_hashes)
        load.unhashed += request.unhashed
        load.prefill += request.prefill

    def prefilled(self, request_id: str) -> None:
        """The request's first token arrived: its prompt no longer waits to be prefilled."""
        request = self._requests.get(request_id)
        if request is not None and request.prefill:
            load = self._instances[request.instance_id]
            load.prefill -= request.prefill
            _uncount(load.prefill_refs, request.prefill_hashes)
            request.prefill, request.prefill_hashes = 0, ()

    def release(self, request_id: str) -> None:
        """The request ended (finished, failed, cancelled, migrated away); unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        load = self._instances[request.instance_id]
        _uncount(load.refs, request.block_hashes)
        _uncount(load.prefill_refs, request.prefill_hashes)
        load.unhashed -= request.unhashed
        load.prefill -= request.prefill
        if not load.refs and not load.unhashed:
            del self._instances[request.instance_id]

    def forget(self, instance_id: str) -> None:
        """The instance is gone: drop its load (its requests' later releases are ignored)."""
        self._instances.pop(instance_id, None)
        for request_id in [
            rid for rid, request in self._requests.items() if request.instance_id == instance_id
        ]:
            del self._requests[request_id]

    def active_blocks(self, instance_id: str) -> int:
        load = self._instances.get(instance_id)
        return 0 if load is None else load.blocks()

    def shared(self, instance_id: str, block_hashes: Sequence[int]) -> tuple[int, int]:
        """How many leading blocks of a prompt (its hashes) the instance's running requests hold,
        and how many of those are still waiting to be prefilled there. The first is found by
        bisection (the blocks held form chains from the first), the second by a walk over it."""
        load = self._instances.get(instance_id)
        if load is None or not block_hashes or block_hashes[0] not in load.refs:
            return 0, 0
        refs = load.refs
        low, high = 1, len(block_hashes)
        while low < high:
            mid = (low + high) // 2
            if block_hashes[mid] in refs:
                low = mid + 1
            else:
                high = mid
        waiting = load.prefill_refs
        return low, sum(1 for block in block_hashes[:low] if block in waiting) if waiting else 0

    def active(self) -> Mapping[str, int]:
        """Active blocks of every instance that has any (a live view: read it, do not keep it)."""
        return _View(self._instances, _Load.blocks)

    def prefilling(self) -> Mapping[str, int]:
        """Blocks each instance has yet to prefill (a live view, like ``active``)."""
        return _View(self._instances, _Load.queued)


def _uncount(refs: Counter[int], blocks: Sequence[int]) -> None:
    for block in blocks:
        remaining = refs[block] - 1
        if remaining:
            refs[block] = remaining
        else:
            del refs[block]


@dataclass(slots=True)
class _Request:
    instance_id: str
    block_hashes: Sequence[int]
    unhashed: int
    prefill: int
    prefill_hashes: Sequence[int]  # the hashed blocks of ``prefill``, until the first token


@dataclass(slots=True)
class _Load:
    refs: Counter[int] = field(default_factory=Counter)  # block hash -> running requests holding it
    prefill_refs: Counter[int] = field(default_factory=Counter)  # -> those still prefilling it
    unhashed: int = 0
    prefill: int = 0

    def blocks(self) -> int:
        return len(self.refs) + self.unhashed

    def queued(self) -> int:
        return self.prefill


class _View(Mapping[str, int]):
    def __init__(self, instances: dict[str, _Load], figure: Callable[[_Load], int]) -> None:
        self._instances = instances
        self._figure = figure

    def __getitem__(self, instance_id: str) -> int:
        return self._figure(self._instances[instance_id])

    def get(self, instance_id: str, default: int = 0) -> int:  # type: ignore[override]
        """Without ``Mapping.get``'s KeyError for every instance without load."""
        load = self._instances.get(instance_id)
        return default if load is None else self._figure(load)

    def __iter__(self) -> Iterator[str]:
        return iter(self._instances)

    def __len__(self) -> int:
        return len(self._instances)


class KvRouter:
    """Hash, match, choose, and track the load: what the frontend calls per request.

    One per model (the index's block size is the model card's ``kv_cache_block_size``). ``seed``
    seeds the sampling at ``temperature > 0``.
    """

    def __init__(
        self,
        index: KvIndex,
        *,
        overlap_score_weight: float = DEFAULT_KV_OVERLAP_SCORE_WEIGHT,
        temperature: float = DEFAULT_ROUTER_TEMPERATURE,
        seed: int | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.index = index
        self.load = LoadTracker()
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = random.Random(seed)
        self._turn = 0
        self._predicted: dict[str, tuple[str, Sequence[int]]] = {}  # request -> (instance, hashes)

    def decide(
        self, candidates: Sequence[str], token_ids: Sequence[int], images: Sequence[ImageSpan] = ()
    ) -> Decision:
        """The instance for this prompt among ``candidates`` (its images in prompt order)."""
        block_size = self.index.block_size
        hashes = request_block_hashes(token_ids, block_size, images)
        blocks = count_blocks(len(token_ids), block_size)
        return self.choose(self.index.match(hashes), blocks, dict.fromkeys(candidates, hashes))

    def choose(
        self,
        overlaps: Mapping[str, int],
        prompt_blocks: int,
        block_hashes: Mapping[str, Sequence[int]],
        capacity: Mapping[str, int] | None = None,
    ) -> Decision:
        """``choose`` among the instances of ``block_hashes`` (each one's hashes of the prompt, as
        rendered for it) with this router's load, index and settings, and the instances' KV
        ``capacity`` when their cards say it."""
        active = self.load.active()
        shared = {i: self.load.shared(i, hashes) for i, hashes in block_hashes.items() if i in active}
        decision = choose(
            list(block_hashes),
            overlaps,
            prompt_blocks,
            active,
            self.index.held(),
            overlap_score_weight=self.overlap_score_weight,
            temperature=self.temperature,
            rng=self._rng,
            turn=self._turn,
            prefilling=self.load.prefilling(),
            capacity=capacity,
            shared=shared,
        )
        self._turn += 1
        return replace(decision, block_hashes=block_hashes[decision.instance_id])

    def dispatch(self, request_id: str, decision: Decision) -> None:
        """The request was sent where ``decision`` says: its prompt blocks count as active there,
        and as cached there (predicted) until the instance's events say so or the prediction ends."""
        uncached = decision.prompt_blocks - decision.overlap_blocks
        self.load.dispatch(
            request_id, decision.instance_id, decision.prompt_blocks, decision.block_hashes, uncached
        )
        predicted = self.index.predict(decision.instance_id, decision.block_hashes)
        if predicted:
            self._predicted[request_id] = (decision.instance_id, predicted)

    def prefilled(self, request_id: str) -> None:
        self.load.prefilled(request_id)
        self._unpredict(request_id)

    def release(self, request_id: str) -> None:
        self.load.release(request_id)
        self._unpredict(request_id)

    def _unpredict(self, request_id: str) -> None:
        found = self._predicted.pop(request_id, None)
        if found is not None:
            self.index.unpredict(*found)
