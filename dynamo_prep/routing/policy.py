"""Where a request goes: the cost of each instance, the choice, and the load the choice adds.

Cost per instance (Dynamo's): ``overlap_score_weight * (prompt_blocks - overlap) + active_blocks``,
the blocks it would still have to prefill plus the blocks its running requests hold. At
temperature 0 the cheapest instance wins; above 0 one is sampled from a softmax over the costs
normalised to [0, 1] (``exp(-normalised / temperature)``), so a higher temperature spreads more.

Beyond Dynamo, the balance rule: when no instance holds at least half the prompt
(``2 * max overlap < prompt_blocks``), the request goes to the least loaded instance (fewest active
blocks, then fewest blocks held) whatever the temperature. A new prefix then lands where there
is room instead of piling onto whichever instance holds a shared preamble (a system prompt, tool
declarations), which would otherwise win every new conversation by a few blocks.

Ties (equal cost, or equal load in the balance rule) go to the instance holding fewer blocks,
then to a round-robin turn over the candidates in id order: with equal figures (a cold start,
all idle) consecutive requests still spread instead of always landing on the lowest id.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from dynamo_prep.protocol.kv_events import ImageSpan
from dynamo_prep.routing.hashing import request_block_hashes
from dynamo_prep.routing.index import KvIndex

__all__ = [
    "DEFAULT_OVERLAP_SCORE_WEIGHT",
    "DEFAULT_TEMPERATURE",
    "Decision",
    "KvRouter",
    "LoadTracker",
    "Reason",
    "choose",
    "count_blocks",
]

DEFAULT_OVERLAP_SCORE_WEIGHT: Final = 1.0
DEFAULT_TEMPERATURE: Final = 0.0

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
    overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
    temperature: float = DEFAULT_TEMPERATURE,
    rng: random.Random | None = None,
    turn: int = 0,
) -> Decision:
    """The instance for a request of ``prompt_blocks`` blocks (see the module docstring).

    Missing entries in the mappings count as 0. ``rng`` is only drawn from when
    ``temperature > 0`` and the cost rule applies; ``turn`` rotates the final tie-break.
    """
    if not candidates:
        raise ValueError("no candidate instance")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    ordered = sorted(set(candidates))
    best_overlap = max([overlaps.get(instance_id, 0) for instance_id in ordered])
    balance = not best_overlap or 2 * best_overlap < prompt_blocks
    costs = [
        overlap_score_weight * (prompt_blocks - overlaps.get(instance_id, 0))
        + active_blocks.get(instance_id, 0)
        for instance_id in ordered
    ]
    if not balance and temperature > 0:
        index = _sample(costs, temperature, rng or random.Random())
    else:
        primary = [active_blocks.get(instance_id, 0) for instance_id in ordered] if balance else costs
        index = _least(primary, ordered, blocks_held, turn)
    chosen = ordered[index]
    reason: Reason = "balance" if balance else "overlap"
    return Decision(chosen, overlaps.get(chosen, 0), prompt_blocks, costs[index], reason)


def _least(primary: Sequence[float], ordered: list[str], blocks_held: Mapping[str, int], turn: int) -> int:
    """Index of the least ``primary``; ties to fewer blocks held, then to the round-robin turn."""
    lowest = min(primary)
    if primary.count(lowest) == 1:
        return primary.index(lowest)
    start = turn % len(ordered)
    tied = [i for i, value in enumerate(primary) if value == lowest]
    return min(tied, key=lambda i: (blocks_held.get(ordered[i], 0), (i - start) % len(ordered)))


def _sample(costs: list[float], temperature: float, rng: random.Random) -> int:
    low, high = min(costs), max(costs)
    if high == low:
        return rng.randrange(len(costs))
    weights = [math.exp(-(value - low) / (high - low) / temperature) for value in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]


class LoadTracker:
    """Active blocks per instance: a request's prompt blocks, from dispatch until it ends.

    Counted as Dynamo counts active blocks: every block of the prompt, cached or not, since the
    engine holds them all for the request's lifetime. Generated tokens are not counted (their
    number is unknown at dispatch and small next to the prompts this router is for).
    """

    def __init__(self) -> None:
        self._active: dict[str, int] = {}
        self._requests: dict[str, tuple[str, int]] = {}

    def dispatch(self, request_id: str, instance_id: str, blocks: int) -> None:
        """``request_id`` now holds ``blocks`` blocks on ``instance_id``; a request id may be active once."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        self._requests[request_id] = (instance_id, blocks)
        self._active[instance_id] = self._active.get(instance_id, 0) + blocks

    def release(self, request_id: str) -> None:
        """The request ended (finished, failed, cancelled, migrated away); unknown ids are ignored."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        instance_id, blocks = entry
        remaining = self._active.get(instance_id, 0) - blocks
        if remaining > 0:
            self._active[instance_id] = remaining
        else:
            self._active.pop(instance_id, None)

    def forget(self, instance_id: str) -> None:
        """The instance is gone: drop its load (its requests' later releases are ignored)."""
        self._active.pop(instance_id, None)
        for request_id in [rid for rid, (owner, _) in self._requests.items() if owner == instance_id]:
            del self._requests[request_id]

    def active_blocks(self, instance_id: str) -> int:
        return self._active.get(instance_id, 0)

    def active(self) -> Mapping[str, int]:
        """Active blocks of every instance that has any (a live view: read it, do not keep it)."""
        return self._active


class KvRouter:
    """Hash, match, choose, and track the load: what the frontend calls per request.

    One per model (the index's block size is the model card's ``kv_cache_block_size``). ``seed``
    seeds the sampling at ``temperature > 0``.
    """

    def __init__(
        self,
        index: KvIndex,
        *,
        overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT,
        temperature: float = DEFAULT_TEMPERATURE,
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

    def decide(
        self, candidates: Sequence[str], token_ids: Sequence[int], images: Sequence[ImageSpan] = ()
    ) -> Decision:
        """The instance for this prompt among ``candidates`` (its images in prompt order)."""
        block_size = self.index.block_size
        overlaps = self.index.match(request_block_hashes(token_ids, block_size, images))
        decision = choose(
            candidates,
            overlaps,
            count_blocks(len(token_ids), block_size),
            self.load.active(),
            self.index.held(),
            overlap_score_weight=self.overlap_score_weight,
            temperature=self.temperature,
            rng=self._rng,
            turn=self._turn,
        )
        self._turn += 1
        return decision

    def dispatch(self, request_id: str, decision: Decision) -> None:
        """The request was sent where ``decision`` says: its prompt blocks count as active there."""
        self.load.dispatch(request_id, decision.instance_id, decision.prompt_blocks)

    def release(self, request_id: str) -> None:
        self.load.release(request_id)
