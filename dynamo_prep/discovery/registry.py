"""The frontend's view of the discovery plane, as a pure state machine.

No sockets and no clock: callers pass ``now`` (monotonic seconds), so every rule (dedup, TTL,
first-card-wins, key binding) is tested without timing. Each call returns typed events that the
watcher turns into log lines, builds and catalog updates.

Rules:

* messages are ordered per instance by ``seq``; an equal or lower ``seq`` is a duplicate (two
  brokers deliver everything twice) or stale, and is dropped. A ``seq`` more than ``MAX_SEQ_JUMP``
  ahead of the last one is refused, and one more than ``MAX_SEQ_JUMP`` behind it restarts the
  sequence, so a forged or corrupt huge ``seq`` cannot lock the real sender out;
* an instance lives until its ``ttl_ms`` passes without news; a withdraw removes it at once and
  leaves a tombstone for one TTL so a late duplicate cannot resurrect it;
* the first accepted card of a model fixes its ``mdcsum``; a card with another one is refused;
* ``runtime_config`` is first-card-wins per model; a later instance that differs is reported (a
  log line, not a data path: each instance's own declaration travels in its ``Instance`` record);
* with CURVE, an instance is bound to the key that first announced it;
* a card is decoded only when its bytes change, so a heartbeat costs a bytes comparison;
* the table is bounded (``max_instances`` in all, ``max_instances_per_model`` per model); when it
  is full, a new instance evicts the oldest instance that is not serving a confirmed model (one the
  frontend built and serves), so junk can fill the table only with junk. Junk reusing a served
  model's files builds too: then a newcomer announcing the card of a model whose workers answer
  requests (``note_answered``: a scale-up of a model in use), or one whose endpoint answered a
  probe (``note_proven``), evicts the instance confirmed last among those of models none of whose
  workers ever answered; nothing else does, so nothing churns;
* an admitted instance is described by one ``Instance`` record (endpoint, declared token, KV-event
  address); when an announce changes it, ``InstanceAdded`` carries the new record again.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from dynamo_prep.card import (
    CardDecodeError,
    CardDecodeResult,
    ModelDeploymentCard,
    ModelRuntimeConfig,
    decode_card,
)
from dynamo_prep.protocol.discovery import (
    Announce,
    DiscoveryMessage,
    Instance,
    KvEventsEndpoint,
    Withdraw,
)

__all__ = [
    "CardRejected",
    "ChecksumMismatch",
    "DiscoveryRegistry",
    "InstanceAdded",
    "InstanceRemoved",
    "KeyMismatch",
    "LegacyDowngrade",
    "ModelFirstSeen",
    "ModelRemoved",
    "ModelSnapshot",
    "RegistryEvent",
    "RuntimeConfigConflict",
]

# A 10,000-instance fleet with room to replace most of it at once (new instances of a rolling
# restart announce before the old ones expire) without evicting or refusing anyone.
DEFAULT_MAX_INSTANCES = 16_384
# Far beyond what message loss explains (a day of 1 s heartbeats), far below a forged 2**64 - 1.
MAX_SEQ_JUMP = 100_000

# Room for the largest fleets of one model (benchmarks/scale.py runs 5,000), while junk announcing a
# served model name (its instances are never evicted) still leaves half the table to others.
DEFAULT_MAX_INSTANCES_PER_MODEL = 8_192
# Distinct card bytes remembered per answered model (its workers' cards: one per deployment).
CARDS_NOTED_PER_MODEL = 8
# Instances remembered as proven live (``note_proven``), the oldest forgotten first.
MAX_PROVEN = 4096

RemovalReason = Literal["withdraw", "expired", "card_changed", "evicted", "revoked"]


@dataclass(frozen=True, slots=True)
class InstanceAdded:
    """An instance serves ``model`` (its card passed every check), or its record changed."""

    model: str
    instance: Instance
    mdcsum: str


@dataclass(frozen=True, slots=True)
class InstanceRemoved:
    """An instance is gone: it withdrew, it expired, or its card now names another model."""

    model: str
    instance: Instance
    reason: RemovalReason


@dataclass(frozen=True, slots=True)
class ModelFirstSeen:
    """The first instance of a model: the frontend must build its preprocessor from ``card``."""

    model: str
    mdcsum: str
    instance: Instance
    card: ModelDeploymentCard


@dataclass(frozen=True, slots=True)
class ModelRemoved:
    """The last instance of a model is gone; the model leaves the catalog."""

    model: str
    mdcsum: str


@dataclass(frozen=True, slots=True)
class CardRejected:
    """A well-formed envelope whose card cannot be used (``reason`` is a stable label)."""

    instance_id: str
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class ChecksumMismatch:
    """A card whose mdcsum differs from the model's canonical one (refused).

    ``fields``: covered field name -> (canonical value, offered value), only those that differ.
    """

    model: str
    instance_id: str
    canonical_mdcsum: str
    mdcsum: str
    fields: Mapping[str, tuple[Any, Any]]


@dataclass(frozen=True, slots=True)
class RuntimeConfigConflict:
    """A later instance whose runtime_config differs from the model's first (first wins).

    ``fields``: runtime_config key -> (first instance's value, this instance's value).
    """

    model: str
    instance_id: str
    first_instance_id: str
    fields: Mapping[str, tuple[Any, Any]]


@dataclass(frozen=True, slots=True)
class LegacyDowngrade:
    """An instance still sends legacy keys (accepted, their meaning is lost: it declares nothing)."""

    model: str
    instance_id: str
    legacy: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class KeyMismatch:
    """A message about an instance bound to another CURVE key; it was refused."""

    instance_id: str
    action: Literal["announce", "withdraw"]
    bound_key: str | None
    offered_key: str | None


RegistryEvent = (
    InstanceAdded
    | InstanceRemoved
    | ModelFirstSeen
    | ModelRemoved
    | CardRejected
    | ChecksumMismatch
    | RuntimeConfigConflict
    | LegacyDowngrade
    | KeyMismatch
)


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """A read-only copy of a model's state (for builds and the catalog)."""

    name: str
    mdcsum: str
    card: ModelDeploymentCard
    runtime_config: ModelRuntimeConfig
    first_instance_id: str
    instances: Mapping[str, Instance]


class _Instance(msgspec.Struct, gc=False):
    """Everything heard from one instance_id, admitted to a model or not (untracked by the GC, as
    every per-instance and per-model record here: none can be part of a reference cycle)."""

    instance_id: str
    user_id: str | None
    last_seq: int = -1
    deadline: float = 0.0
    scheduled: float | None = None  # its entry in the deadline heap (at most ``deadline``)
    ttl_s: float = 0.0
    endpoint: str = ""
    kv_events: KvEventsEndpoint | None = None
    raw: bytes | None = None
    decoded: CardDecodeResult | None = None
    mdcsum: str = ""
    model: str | None = None
    legacy_reported: bool = False
    mismatch_reported: str | None = None


class _Model(msgspec.Struct, gc=False):
    name: str
    mdcsum: str
    card: ModelDeploymentCard
    first_instance_id: str
    instances: dict[str, Instance] = msgspec.field(default_factory=dict)
    confirmed: bool = False
    answered: bool = False
    cards: tuple[bytes, ...] = ()  # its card bytes in ``_answered_cards`` (an answered model's)


class DiscoveryRegistry:
    """Live instances by instance_id and models by display_name; see the module docstring."""

    def __init__(
        self,
        *,
        max_instances: int = DEFAULT_MAX_INSTANCES,
        max_instances_per_model: int = DEFAULT_MAX_INSTANCES_PER_MODEL,
    ) -> None:
        self._instances: dict[str, _Instance] = {}
        self._models: dict[str, _Model] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._max_instances = max_instances
        self._max_per_model = max_instances_per_model
        # Tracked instances outside confirmed models, oldest first: who goes when the table is full.
        self._evictable: dict[str, None] = {}
        # Instances of confirmed models no worker of which answered yet, by confirmation: the last goes
        # for a newcomer whose card is one of ``_answered_cards`` (raw card -> its answered model).
        self._unanswered: dict[str, None] = {}
        self._answered_cards: dict[bytes, str] = {}
        self._proven: dict[str, None] = {}  # instances whose endpoint answered a probe, oldest first
        self.counters: dict[str, int] = dict.fromkeys(
            ("duplicate", "stale", "cards_decoded", "seq_jump", "seq_restart"), 0
        )

    # -- queries -----------------------------------------------------------------------------

    def model(self, name: str) -> ModelSnapshot | None:
        """A copy of a model's state, or None when no instance of it is live."""
        model = self._models.get(name)
        if model is None:
            return None
        return ModelSnapshot(
            name=model.name,
            mdcsum=model.mdcsum,
            card=model.card,
            runtime_config=model.card.runtime_config,
            first_instance_id=model.first_instance_id,
            instances=dict(model.instances),
        )

    def instance_count(self, name: str) -> int:
        """Live instances of a model, without the copy ``model()`` makes (per event at scale)."""
        model = self._models.get(name)
        return 0 if model is None else len(model.instances)

    def model_card(self, name: str) -> ModelDeploymentCard | None:
        """A model's canonical card, without the copy ``model()`` makes."""
        model = self._models.get(name)
        return None if model is None else model.card

    def model_names(self) -> list[str]:
        return sorted(self._models)

    def model_count(self) -> int:
        return len(self._models)

    def model_of(self, instance_id: str) -> str | None:
        """The model an instance is admitted to (None: unknown, rejected or withdrawn)."""
        instance = self._instances.get(instance_id)
        return None if instance is None else instance.model

    def serving(self, instance_id: str, seq: int) -> bool:
        """Whether ``seq`` is the last message accepted from an instance admitted to a model: its
        announce was news, not a duplicate, a stale copy or a refused one."""
        instance = self._instances.get(instance_id)
        return instance is not None and instance.model is not None and instance.last_seq == seq

    def next_deadline(self) -> float | None:
        """The earliest instance deadline, so the caller knows how long it may sleep."""
        due = self._due()
        return None if due is None else due[0]

    def _due(self) -> tuple[float, _Instance] | None:
        """The earliest deadline and its instance. A heartbeat only moves ``deadline`` (a later one
        is not pushed): an entry found stale here moves to its instance's deadline, so the heap
        holds about one entry per instance, whatever the heartbeat rate and the TTL."""
        heap = self._deadlines
        while heap:
            scheduled, instance_id = heap[0]
            instance = self._instances.get(instance_id)
            if instance is None or instance.scheduled != scheduled:
                heapq.heappop(heap)  # forgotten, or superseded by an earlier entry
            elif instance.deadline > scheduled:
                instance.scheduled = instance.deadline
                heapq.heapreplace(heap, (instance.deadline, instance_id))
            else:
                return scheduled, instance
        return None

    # -- updates -----------------------------------------------------------------------------

    def apply(
        self,
        message: DiscoveryMessage,
        *,
        now: float,
        raw_card: bytes | None = None,
        user_id: str | None = None,
    ) -> list[RegistryEvent]:
        """Apply one decoded message; ``raw_card`` defaults to the announce's raw card bytes."""
        if isinstance(message, Withdraw):
            return self._withdraw(message, now=now, user_id=user_id)
        raw = bytes(message.card) if raw_card is None else raw_card
        return self._announce(message, raw, now=now, user_id=user_id)

    def confirm(self, name: str) -> None:
        """``name`` is built and served: its instances are never evicted for newcomers."""
        model = self._models.get(name)
        if model is None:
            return
        model.confirmed = True
        for instance_id in model.instances:
            self._keep(model, instance_id)

    def _keep(self, model: _Model, instance_id: str) -> None:
        """An instance of a confirmed model is not evicted for any newcomer; unless its model answered
        or it proved live, it is in ``_unanswered`` (it may go for a newcomer vouched for)."""
        self._evictable.pop(instance_id, None)
        if not model.answered and instance_id not in self._proven:
            self._unanswered[instance_id] = None

    def note_proven(self, instance_id: str) -> None:
        """``instance_id``'s endpoint answered a probe (the watcher probes a newcomer the full table
        refused): it is kept like an instance of a model in use, and gets in as one."""
        self._proven.pop(instance_id, None)
        self._proven[instance_id] = None
        if len(self._proven) > MAX_PROVEN:
            del self._proven[next(iter(self._proven))]
        self._evictable.pop(instance_id, None)
        self._unanswered.pop(instance_id, None)

    def note_answered(self, name: str) -> None:
        """A worker of ``name`` answered a request: a newcomer announcing its card may take the
        place of an instance of a served model that never answered one (see the module docstring)."""
        model = self._models.get(name)
        if model is None or model.answered:
            return
        model.answered = True
        for instance_id in model.instances:
            self._unanswered.pop(instance_id, None)
            self._note_card(model, self._instances[instance_id])

    def _note_card(self, model: _Model, instance: _Instance) -> None:
        """Remember an answered model's card bytes (a few per model: junk under its name, each card
        different, must not grow this)."""
        raw = instance.raw
        if not model.answered or raw is None or len(model.cards) >= CARDS_NOTED_PER_MODEL:
            return
        if raw not in self._answered_cards:
            model.cards += (raw,)
            self._answered_cards[raw] = model.name

    def revoke(self, keys: frozenset[str]) -> list[RegistryEvent]:
        """Forget every instance bound to one of ``keys`` (removed from the CURVE allow-list)."""
        events: list[RegistryEvent] = []
        for instance in [i for i in self._instances.values() if i.user_id in keys]:
            events.extend(self._forget(instance, "revoked"))
        return events

    def expire(self, now: float) -> list[RegistryEvent]:
        """Remove every instance (and tombstone) whose deadline has passed."""
        events: list[RegistryEvent] = []
        while (due := self._due()) is not None and due[0] <= now:
            heapq.heappop(self._deadlines)
            events.extend(self._forget(due[1], "expired"))
        return events

    def _forget(self, instance: _Instance, reason: RemovalReason) -> list[RegistryEvent]:
        del self._instances[instance.instance_id]
        self._evictable.pop(instance.instance_id, None)
        return self._detach(instance, reason)

    def _room_for(self, instance_id: str, raw: bytes) -> str | None:
        """The instance that makes room for a newcomer in a full table, if any."""
        if self._evictable:
            return next(iter(self._evictable))
        if self._unanswered and (raw in self._answered_cards or instance_id in self._proven):
            return next(reversed(self._unanswered))
        return None

    # -- announce ----------------------------------------------------------------------------

    def _announce(
        self, message: Announce, raw: bytes, *, now: float, user_id: str | None
    ) -> list[RegistryEvent]:
        events: list[RegistryEvent] = []
        instance = self._instances.get(message.instance_id)
        if instance is None:
            if len(self._instances) >= self._max_instances:
                victim = self._room_for(message.instance_id, raw)
                if victim is None:
                    detail = f"{self._max_instances} instances of served models tracked already"
                    return [CardRejected(message.instance_id, "too_many_instances", detail)]
                events.extend(self._forget(self._instances[victim], "evicted"))
            instance = _Instance(message.instance_id, user_id)
            self._instances[message.instance_id] = instance
            if message.instance_id not in self._proven:
                self._evictable[message.instance_id] = None
        refused = self._refuse(instance, message.seq, "announce", user_id)
        if refused is not None:
            return events + refused
        instance.last_seq = message.seq
        instance.endpoint = message.endpoint
        instance.kv_events = None if isinstance(message.kv_events, msgspec.UnsetType) else message.kv_events
        instance.ttl_s = message.ttl_ms / 1000
        self._refresh(instance, now + instance.ttl_s)
        if raw != instance.raw:
            events.extend(self._new_card(instance, raw))
        if instance.model is None and instance.decoded is not None:
            events.extend(self._admit(instance, instance.decoded))
        elif instance.model is not None:
            events.extend(self._update(self._models[instance.model], instance))
        return events

    def _update(self, model: _Model, instance: _Instance) -> list[RegistryEvent]:
        """A heartbeat of an admitted instance: an event only when its record changed."""
        record = _record(instance)
        if model.instances.get(instance.instance_id) == record:
            return []
        model.instances[instance.instance_id] = record
        return [InstanceAdded(model.name, record, instance.mdcsum)]

    def _refuse(
        self, instance: _Instance, seq: int, action: Literal["announce", "withdraw"], user_id: str | None
    ) -> list[RegistryEvent] | None:
        """Key binding first (a foreign key learns nothing about seq), then ordering."""
        if instance.user_id != user_id:
            return [KeyMismatch(instance.instance_id, action, instance.user_id, user_id)]
        last = instance.last_seq
        if last >= 0 and seq > last + MAX_SEQ_JUMP:
            self.counters["seq_jump"] += 1
            detail = f"instance {instance.instance_id}: seq {seq} is more than {MAX_SEQ_JUMP} past {last}"
            return [CardRejected(instance.instance_id, "seq_jump", detail)]
        if seq <= last and last - seq > MAX_SEQ_JUMP:
            self.counters["seq_restart"] += 1  # the sender's counter restarted, or the last seq was forged
            return None
        if seq <= last:
            self.counters["duplicate" if seq == last else "stale"] += 1
            return []
        return None

    def _refresh(self, instance: _Instance, deadline: float) -> None:
        instance.deadline = deadline
        if instance.scheduled is None or deadline < instance.scheduled:
            instance.scheduled = deadline
            heapq.heappush(self._deadlines, (deadline, instance.instance_id))

    def _new_card(self, instance: _Instance, raw: bytes) -> list[RegistryEvent]:
        """Decode changed card bytes; a card for another model detaches the instance first."""
        instance.raw = raw
        self.counters["cards_decoded"] += 1
        try:
            decoded = decode_card(raw)
        except CardDecodeError as exc:
            instance.decoded = None
            return [
                *self._detach(instance, "card_changed"),
                CardRejected(instance.instance_id, "invalid_card", str(exc)),
            ]
        instance.decoded = decoded
        instance.mdcsum = decoded.card.mdcsum()
        model = self._models.get(instance.model) if instance.model is not None else None
        if model is None:
            return []
        if decoded.card.display_name == model.name and instance.mdcsum == model.mdcsum:
            return self._check_runtime_config(model, instance.instance_id, decoded.card)
        return self._detach(instance, "card_changed")

    def _admit(self, instance: _Instance, decoded: CardDecodeResult) -> list[RegistryEvent]:
        card, mdcsum = decoded.card, instance.mdcsum
        model = self._models.get(card.display_name)
        record = _record(instance)
        events: list[RegistryEvent] = []
        if model is None:
            model = _Model(card.display_name, mdcsum, card, instance.instance_id)
            self._models[model.name] = model
            events.append(ModelFirstSeen(model.name, mdcsum, record, card))
        elif model.mdcsum != mdcsum:
            return self._mismatch(model, instance, card, mdcsum)
        elif len(model.instances) >= self._max_per_model:
            detail = f"model {model.name} has {self._max_per_model} instances already"
            return [CardRejected(instance.instance_id, "too_many_instances_of_model", detail)]
        else:
            events.extend(self._check_runtime_config(model, instance.instance_id, card))
        model.instances[instance.instance_id] = record
        if model.confirmed:
            self._keep(model, instance.instance_id)
        self._note_card(model, instance)
        instance.model = model.name
        instance.mismatch_reported = None
        events.append(InstanceAdded(model.name, record, mdcsum))
        if decoded.legacy and not instance.legacy_reported:
            instance.legacy_reported = True
            events.append(LegacyDowngrade(model.name, instance.instance_id, dict(decoded.legacy)))
        return events

    def _mismatch(
        self, model: _Model, instance: _Instance, card: ModelDeploymentCard, mdcsum: str
    ) -> list[RegistryEvent]:
        """Refuse the card; report once per (instance, canonical checksum), not every heartbeat."""
        if instance.mismatch_reported == model.mdcsum:
            return []
        instance.mismatch_reported = model.mdcsum
        fields = _differences(model.card.mdcsum_fields(), card.mdcsum_fields())
        return [ChecksumMismatch(model.name, instance.instance_id, model.mdcsum, mdcsum, fields)]

    @staticmethod
    def _check_runtime_config(
        model: _Model, instance_id: str, card: ModelDeploymentCard
    ) -> list[RegistryEvent]:
        if instance_id == model.first_instance_id:
            return []
        first = msgspec.structs.asdict(model.card.runtime_config)
        later = msgspec.structs.asdict(card.runtime_config)
        fields = _differences(first, later)
        return (
            [RuntimeConfigConflict(model.name, instance_id, model.first_instance_id, fields)]
            if fields
            else []
        )

    # -- withdraw and removal ----------------------------------------------------------------

    def _withdraw(self, message: Withdraw, *, now: float, user_id: str | None) -> list[RegistryEvent]:
        instance = self._instances.get(message.instance_id)
        if instance is None:
            self.counters["stale"] += 1
            return []
        refused = self._refuse(instance, message.seq, "withdraw", user_id)
        if refused is not None:
            return refused
        instance.last_seq = message.seq
        self._refresh(instance, now + instance.ttl_s)  # tombstone: late duplicates of older seqs stay dropped
        return self._detach(instance, "withdraw")

    def _detach(self, instance: _Instance, reason: RemovalReason) -> list[RegistryEvent]:
        """Take an instance out of its model; the model goes with its last instance."""
        name, instance.model = instance.model, None
        model = self._models.get(name) if name is not None else None
        if model is None:
            return []
        self._unanswered.pop(instance.instance_id, None)
        if instance.instance_id in self._instances:  # still tracked (withdrawn, or its card changed)
            self._evictable[instance.instance_id] = None
        record = model.instances.pop(instance.instance_id, None) or _record(instance)
        events: list[RegistryEvent] = [InstanceRemoved(model.name, record, reason)]
        if not model.instances:
            del self._models[model.name]
            for raw in model.cards:
                del self._answered_cards[raw]
            events.append(ModelRemoved(model.name, model.mdcsum))
        return events


def _record(instance: _Instance) -> Instance:
    """The instance as every later layer sees it: from its last accepted announce and card."""
    decoded = instance.decoded
    if decoded is None:
        return Instance(
            instance_id=instance.instance_id, endpoint=instance.endpoint, kv_events=instance.kv_events
        )
    runtime = decoded.card.runtime_config
    return Instance(
        instance_id=instance.instance_id,
        endpoint=instance.endpoint,
        declared_token=runtime.image_placeholder_token,
        kv_events=instance.kv_events,
        total_kv_blocks=runtime.total_kv_blocks or None,  # 0 says nothing: no capacity is known
        max_num_seqs=runtime.max_num_seqs or None,
    )


def _differences(first: Mapping[str, Any], later: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """name -> (first, later) for every key whose values differ (a missing key reads as None)."""
    return {
        key: (first.get(key), later.get(key))
        for key in sorted(first.keys() | later.keys())
        if first.get(key) != later.get(key)
    }
