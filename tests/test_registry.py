"""The discovery registry as a pure state machine: no sockets, time passed in."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig, encode_card
from dynamo_prep.discovery.registry import (
    CardRejected,
    ChecksumMismatch,
    DiscoveryRegistry,
    InstanceAdded,
    InstanceRemoved,
    KeyMismatch,
    LegacyDowngrade,
    ModelFirstSeen,
    ModelRemoved,
    RegistryEvent,
    RuntimeConfigConflict,
)
from dynamo_prep.protocol.discovery import Announce, Instance, KvEventsEndpoint, Withdraw

K3 = "kimi-k3-demo"
ENDPOINT = "tcp://127.0.0.1:1100"
MEDIA_PAD = "<|media_pad|>"


@pytest.fixture(scope="module")
def k3_card() -> ModelDeploymentCard:
    return ModelDeploymentCard.from_model_dir(K3)


def card_bytes(card: ModelDeploymentCard, **runtime: Any) -> bytes:
    """The card's wire bytes; runtime keys are merged raw (so legacy keys can be sent)."""
    if not runtime:
        return encode_card(card)
    fields = msgspec.msgpack.decode(encode_card(card))
    fields["runtime_config"] = {**fields.get("runtime_config", {}), **runtime}
    return msgspec.msgpack.encode(fields)


def announce(
    instance_id: str, seq: int, raw: bytes, *, ttl_ms: int = 3000, endpoint: str = ENDPOINT, **extra: Any
) -> Announce:
    return Announce(
        instance_id=instance_id,
        seq=seq,
        sent_ms=0,
        ttl_ms=ttl_ms,
        endpoint=endpoint,
        card=msgspec.Raw(raw),
        **extra,
    )


def instance(instance_id: str, declared_token: str | None = None, **fields: Any) -> Instance:
    return Instance(instance_id=instance_id, endpoint=ENDPOINT, declared_token=declared_token, **fields)


def withdraw(instance_id: str, seq: int) -> Withdraw:
    return Withdraw(instance_id=instance_id, seq=seq, sent_ms=0)


def kinds(events: list[RegistryEvent]) -> list[str]:
    return [type(event).__name__ for event in events]


def test_first_announce_adds_model_and_instance(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    events = registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    assert kinds(events) == ["ModelFirstSeen", "InstanceAdded"]
    first = events[0]
    assert isinstance(first, ModelFirstSeen)
    assert first.model == "kimi-k3-demo"
    assert first.mdcsum == k3_card.mdcsum()
    assert first.instance == instance("a")
    assert first.card == k3_card
    snapshot = registry.model("kimi-k3-demo")
    assert snapshot is not None
    assert dict(snapshot.instances) == {"a": instance("a")}
    assert registry.model_of("a") == "kimi-k3-demo"


def test_second_instance_only_adds_instance(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    events = registry.apply(announce("b", 1, card_bytes(k3_card)), now=0.1)
    assert events == [InstanceAdded("kimi-k3-demo", instance("b"), k3_card.mdcsum())]


def test_each_instance_record_carries_its_own_card_s_kv_capacity(k3_card: ModelDeploymentCard) -> None:
    """Per instance, not per model: the KV router weighs each engine's load against its own size."""
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card, total_kv_blocks=4096)), now=0.0)
    events = registry.apply(announce("b", 1, card_bytes(k3_card, total_kv_blocks=1024)), now=0.1)
    assert [event.instance for event in events if isinstance(event, InstanceAdded)] == [
        instance("b", total_kv_blocks=1024)
    ]
    snapshot = registry.model("kimi-k3-demo")
    assert snapshot is not None and snapshot.instances["a"] == instance("a", total_kv_blocks=4096)


def test_heartbeat_is_silent_and_refreshes_deadline(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw, ttl_ms=1000), now=0.0)
    assert registry.next_deadline() == pytest.approx(1.0)
    assert registry.apply(announce("a", 2, raw, ttl_ms=1000), now=0.5) == []
    assert registry.next_deadline() == pytest.approx(1.5)
    assert registry.expire(1.2) == []


def test_heartbeats_keep_one_deadline_entry_per_instance(k3_card: ModelDeploymentCard) -> None:
    """Issue 13: every heartbeat pushed a heap entry that lived until its deadline, so 10,000 junk
    instances with a 600 s TTL heartbeating every 0.1 s grew the heap by 100,000 entries a second.
    A later deadline now moves the instance's one entry lazily; an earlier one (a shorter TTL) is
    pushed, so expiry is never late."""
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    for seq in range(1, 1001):
        registry.apply(announce("a", seq, raw, ttl_ms=600_000), now=seq * 0.1)
    assert len(registry._deadlines) == 1
    assert registry.next_deadline() == pytest.approx(700.0)
    assert registry.expire(650.0) == []
    registry.apply(announce("a", 1001, raw, ttl_ms=1000), now=650.0)  # the TTL shrinks
    assert registry.next_deadline() == pytest.approx(651.0)
    assert kinds(registry.expire(651.5)) == ["InstanceRemoved", "ModelRemoved"]
    assert registry.next_deadline() is None and registry._deadlines == []


@pytest.mark.parametrize(("seq", "counter"), [(5, "duplicate"), (4, "stale"), (0, "stale")])
def test_duplicate_and_stale_messages_are_dropped(
    k3_card: ModelDeploymentCard, seq: int, counter: str
) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 5, raw, ttl_ms=1000), now=0.0)
    assert registry.apply(announce("a", seq, raw, ttl_ms=1000), now=0.9) == []
    assert registry.counters[counter] == 1
    # a dropped message does not refresh the deadline
    assert registry.next_deadline() == pytest.approx(1.0)


def test_stale_withdraw_is_dropped(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 5, card_bytes(k3_card)), now=0.0)
    assert registry.apply(withdraw("a", 3), now=0.1) == []
    assert registry.model_of("a") == "kimi-k3-demo"


def test_two_brokers_deliver_twice_and_nothing_doubles(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    events: list[RegistryEvent] = []
    for seq in range(1, 4):
        for _broker in range(2):
            events += registry.apply(announce("a", seq, raw), now=seq * 0.1)
    events += registry.apply(withdraw("a", 4), now=0.5)
    events += registry.apply(withdraw("a", 4), now=0.5)
    assert kinds(events) == ["ModelFirstSeen", "InstanceAdded", "InstanceRemoved", "ModelRemoved"]
    assert registry.counters["duplicate"] == 4


def test_expiry_removes_instance_then_model(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw, ttl_ms=1000), now=0.0)
    registry.apply(announce("b", 1, raw, ttl_ms=2000), now=0.0)
    assert registry.expire(0.99) == []
    events = registry.expire(1.0)
    assert events == [InstanceRemoved("kimi-k3-demo", instance("a"), "expired")]
    assert registry.next_deadline() == pytest.approx(2.0)
    events = registry.expire(5.0)
    assert kinds(events) == ["InstanceRemoved", "ModelRemoved"]
    assert events[1] == ModelRemoved("kimi-k3-demo", k3_card.mdcsum())
    assert registry.model("kimi-k3-demo") is None
    assert registry.next_deadline() is None


def test_withdraw_removes_at_once_and_tombstone_blocks_late_duplicates(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw, ttl_ms=1000), now=0.0)
    events = registry.apply(withdraw("a", 2), now=0.2)
    assert events == [
        InstanceRemoved("kimi-k3-demo", instance("a"), "withdraw"),
        ModelRemoved("kimi-k3-demo", k3_card.mdcsum()),
    ]
    # the second broker's copy of the last announce arrives after the withdraw
    assert registry.apply(announce("a", 1, raw, ttl_ms=1000), now=0.3) == []
    assert registry.model_of("a") is None
    # the tombstone goes away silently after one TTL
    assert registry.expire(1.3) == []
    assert registry.next_deadline() is None


def test_withdraw_of_unknown_instance_is_ignored() -> None:
    registry = DiscoveryRegistry()
    assert registry.apply(withdraw("ghost", 1), now=0.0) == []


def test_checksum_mismatch_lists_differing_fields_once(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    other = msgspec.structs.replace(k3_card, context_length=4096, kv_cache_block_size=32)
    raw = card_bytes(other)
    events = registry.apply(announce("b", 1, raw), now=0.1)
    assert len(events) == 1
    mismatch = events[0]
    assert isinstance(mismatch, ChecksumMismatch)
    assert mismatch.canonical_mdcsum == k3_card.mdcsum()
    assert mismatch.mdcsum == other.mdcsum()
    assert dict(mismatch.fields) == {"context_length": (8192, 4096), "kv_cache_block_size": (16, 32)}
    assert registry.model_of("b") is None
    # refused every heartbeat, reported once
    assert registry.apply(announce("b", 2, raw), now=1.1) == []
    snapshot = registry.model("kimi-k3-demo")
    assert snapshot is not None and set(snapshot.instances) == {"a"}


def test_checksum_mismatch_names_changed_files(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    files = dict(k3_card.files)
    old = files["tiktoken.model"]
    files["tiktoken.model"] = msgspec.structs.replace(old, sha256="0" * 64)
    events = registry.apply(
        announce("b", 1, card_bytes(msgspec.structs.replace(k3_card, files=files))), now=0
    )
    assert isinstance(events[0], ChecksumMismatch)
    assert dict(events[0].fields) == {"files.tiktoken.model": (old.sha256, "0" * 64)}


def test_mismatched_instance_is_admitted_once_the_old_model_is_gone(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("old", 1, card_bytes(k3_card), ttl_ms=1000), now=0.0)
    new = msgspec.structs.replace(k3_card, context_length=4096)
    raw = card_bytes(new)
    assert kinds(registry.apply(announce("new", 1, raw, ttl_ms=5000), now=0.0)) == ["ChecksumMismatch"]
    assert kinds(registry.expire(1.0)) == ["InstanceRemoved", "ModelRemoved"]
    events = registry.apply(announce("new", 2, raw, ttl_ms=5000), now=1.5)
    assert kinds(events) == ["ModelFirstSeen", "InstanceAdded"]
    assert registry.counters["cards_decoded"] == 2  # the same bytes were not decoded again


def test_runtime_config_conflict_reports_both_values(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("vllm", 1, card_bytes(k3_card)), now=0.0)
    raw = card_bytes(k3_card, image_placeholder_token="<|media_pad|>", max_num_seqs=8)
    events = registry.apply(announce("sglang", 1, raw), now=0.1)
    assert kinds(events) == ["RuntimeConfigConflict", "InstanceAdded"]
    expected = instance("sglang", MEDIA_PAD, max_num_seqs=8)  # each record carries its own capacity
    assert events[1] == InstanceAdded("kimi-k3-demo", expected, k3_card.mdcsum())
    conflict = events[0]
    assert isinstance(conflict, RuntimeConfigConflict)
    assert conflict.first_instance_id == "vllm"
    assert dict(conflict.fields) == {
        "image_placeholder_token": (None, "<|media_pad|>"),
        "max_num_seqs": (None, 8),
    }
    snapshot = registry.model("kimi-k3-demo")
    assert snapshot is not None
    assert snapshot.runtime_config.image_placeholder_token is None  # first card wins
    # heartbeats with the same bytes do not repeat the conflict
    assert registry.apply(announce("sglang", 2, raw), now=0.2) == []


def test_same_runtime_config_is_no_conflict(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card, image_placeholder_token="<|media_pad|>")
    registry.apply(announce("a", 1, raw), now=0.0)
    assert kinds(registry.apply(announce("b", 1, raw), now=0.0)) == ["InstanceAdded"]


def test_legacy_card_is_accepted_and_reported_once_per_instance(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card, expands_image_pad_token=True)
    events = registry.apply(announce("old", 1, raw, ttl_ms=1000), now=0.0)
    assert kinds(events) == ["ModelFirstSeen", "InstanceAdded", "LegacyDowngrade"]
    assert events[2] == LegacyDowngrade("kimi-k3-demo", "old", {"expands_image_pad_token": True})
    first = events[0]
    assert isinstance(first, ModelFirstSeen)
    assert first.card.runtime_config.image_placeholder_token is None
    assert registry.apply(announce("old", 2, raw, ttl_ms=1000), now=0.5) == []
    # withdrawn and re-announced (same instance): still not repeated
    registry.apply(withdraw("old", 3), now=0.6)
    assert kinds(registry.apply(announce("old", 4, raw, ttl_ms=1000), now=0.7)) == [
        "ModelFirstSeen",
        "InstanceAdded",
    ]
    # another legacy instance is reported on its own
    events = registry.apply(announce("old2", 1, raw), now=0.8)
    assert kinds(events) == ["InstanceAdded", "LegacyDowngrade"]


def test_a_legacy_instance_declares_nothing_whatever_the_models_first_card_says(
    k3_card: ModelDeploymentCard,
) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("new", 1, card_bytes(k3_card, image_placeholder_token=MEDIA_PAD)), now=0)
    events = registry.apply(announce("old", 1, card_bytes(k3_card, expands_image_pad_token=True)), now=0)
    added = [event for event in events if isinstance(event, InstanceAdded)]
    assert [event.instance for event in added] == [instance("old", None)]
    assert kinds(events)[-1] == "LegacyDowngrade"


def test_a_changed_declaration_of_a_live_instance_travels_in_its_new_record(
    k3_card: ModelDeploymentCard,
) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    registry.apply(announce("b", 1, card_bytes(k3_card)), now=0.0)
    events = registry.apply(announce("b", 2, card_bytes(k3_card, image_placeholder_token=MEDIA_PAD)), now=0.1)
    assert kinds(events) == ["RuntimeConfigConflict", "InstanceAdded"]
    assert events[1] == InstanceAdded("kimi-k3-demo", instance("b", MEDIA_PAD), k3_card.mdcsum())
    snapshot = registry.model("kimi-k3-demo")
    assert snapshot is not None and snapshot.instances["b"] == instance("b", MEDIA_PAD)


def test_a_changed_endpoint_or_kv_events_address_is_a_new_record(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw), now=0.0)
    moved = "tcp://127.0.0.1:2200"
    events = registry.apply(announce("a", 2, raw, endpoint=moved), now=0.1)
    assert events == [
        InstanceAdded(
            "kimi-k3-demo", msgspec.structs.replace(instance("a"), endpoint=moved), k3_card.mdcsum()
        )
    ]
    kv = KvEventsEndpoint(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    events = registry.apply(announce("a", 3, raw, endpoint=moved, kv_events=kv), now=0.2)
    assert [event.instance.kv_events for event in events if isinstance(event, InstanceAdded)] == [kv]
    assert registry.apply(announce("a", 4, raw, endpoint=moved, kv_events=kv), now=0.3) == []


def test_instance_is_bound_to_its_first_key(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw), now=0.0, user_id="KEY-A")
    events = registry.apply(announce("a", 2, raw), now=0.1, user_id="KEY-B")
    assert events == [KeyMismatch("a", "announce", "KEY-A", "KEY-B")]
    events = registry.apply(withdraw("a", 3), now=0.2, user_id="KEY-B")
    assert events == [KeyMismatch("a", "withdraw", "KEY-A", "KEY-B")]
    assert registry.model_of("a") == "kimi-k3-demo"
    # the foreign key's high seq did not advance the instance's own sequence
    assert registry.apply(announce("a", 2, raw), now=0.3, user_id="KEY-A") == []
    assert registry.counters["duplicate"] == 0
    assert kinds(registry.apply(withdraw("a", 3), now=0.4, user_id="KEY-A")) == [
        "InstanceRemoved",
        "ModelRemoved",
    ]


def test_unchanged_card_bytes_are_not_decoded_again(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    for seq in range(1, 50):
        registry.apply(announce("a", seq, raw), now=seq * 0.01)
    assert registry.counters["cards_decoded"] == 1
    registry.apply(announce("a", 50, card_bytes(k3_card, max_num_seqs=4)), now=1.0)
    assert registry.counters["cards_decoded"] == 2


def test_invalid_card_is_rejected_once_and_never_admitted(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    bad = msgspec.msgpack.encode({"display_name": 7})
    events = registry.apply(announce("a", 1, bad), now=0.0)
    assert len(events) == 1 and isinstance(events[0], CardRejected)
    assert events[0].reason == "invalid_card"
    assert "display_name" in events[0].detail
    assert registry.apply(announce("a", 2, bad), now=0.1) == []
    assert registry.counters["cards_decoded"] == 1
    assert registry.model_names() == []
    # the worker fixes its card: admitted
    assert kinds(registry.apply(announce("a", 3, card_bytes(k3_card)), now=0.2)) == [
        "ModelFirstSeen",
        "InstanceAdded",
    ]


def test_card_turning_invalid_detaches_the_instance(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    events = registry.apply(announce("a", 2, b"\xc1"), now=0.1)
    assert kinds(events) == ["InstanceRemoved", "ModelRemoved", "CardRejected"]
    assert isinstance(events[0], InstanceRemoved) and events[0].reason == "card_changed"


def test_card_for_another_model_moves_the_instance(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    renamed = msgspec.structs.replace(k3_card, display_name="k3-renamed")
    events = registry.apply(announce("a", 2, card_bytes(renamed)), now=0.1)
    assert kinds(events) == ["InstanceRemoved", "ModelRemoved", "ModelFirstSeen", "InstanceAdded"]
    assert registry.model_names() == ["k3-renamed"]


def test_runtime_config_change_of_a_later_instance_is_reported(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    registry.apply(announce("b", 1, card_bytes(k3_card)), now=0.0)
    events = registry.apply(announce("b", 2, card_bytes(k3_card, max_num_seqs=2)), now=0.1)
    assert kinds(events) == ["RuntimeConfigConflict", "InstanceAdded"]  # its record says its capacity
    assert isinstance(events[1], InstanceAdded) and events[1].instance.max_num_seqs == 2
    assert registry.model_of("b") == "kimi-k3-demo"


def test_a_full_table_evicts_the_oldest_instance_of_an_unserved_model(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry(max_instances=2)
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw), now=0.0)
    registry.apply(announce("b", 1, raw), now=0.0)
    events = registry.apply(announce("c", 1, raw), now=0.0)
    assert kinds(events) == ["InstanceRemoved", "InstanceAdded"]
    assert events[0] == InstanceRemoved(K3, instance("a"), "evicted")
    # once the frontend serves the model (built), its instances are never evicted for newcomers
    registry.confirm(K3)
    events = registry.apply(announce("d", 1, raw), now=0.1)
    assert len(events) == 1 and isinstance(events[0], CardRejected)
    assert events[0].reason == "too_many_instances"
    assert registry.apply(announce("b", 2, raw), now=0.1) == []  # known instances keep working


def test_junk_cannot_push_out_the_instances_of_a_served_model(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry(max_instances=3)
    registry.apply(announce("real", 1, card_bytes(k3_card)), now=0.0)
    registry.confirm(K3)
    for index in range(10):  # a flood of spoofed names: each evicts the previous junk, never "real"
        junk = msgspec.structs.replace(k3_card, display_name=f"junk-{index}")
        registry.apply(announce(f"junk-{index}", 1, card_bytes(junk)), now=0.1)
    assert registry.model_of("real") == K3
    assert len(registry.model_names()) == 3
    # a second real worker still gets in: it evicts junk
    assert "InstanceAdded" in kinds(registry.apply(announce("real-2", 1, card_bytes(k3_card)), now=0.2))


def test_a_scale_up_of_a_model_in_use_gets_into_a_table_full_of_served_junk(
    k3_card: ModelDeploymentCard,
) -> None:
    """Issue 13: junk names reusing a served model's files build, so their instances are kept; a
    newcomer announcing the card of a model whose workers answered requests still gets in, in place
    of the instance confirmed last among models whose workers never answered. Nothing else evicts them."""
    registry = DiscoveryRegistry(max_instances=3)
    registry.apply(announce("real", 1, card_bytes(k3_card)), now=0.0)
    registry.confirm(K3)
    junk_cards = [card_bytes(msgspec.structs.replace(k3_card, display_name=f"junk-{i}")) for i in range(3)]
    for index in range(2):
        registry.apply(announce(f"junk-{index}", 1, junk_cards[index]), now=0.1)
        registry.confirm(f"junk-{index}")
    # no worker of kimi-k3-demo answered yet: a scale-up is refused like anything else
    assert kinds(registry.apply(announce("real-2", 1, card_bytes(k3_card)), now=0.2)) == ["CardRejected"]
    registry.note_answered(K3)
    events = registry.apply(announce("real-2", 2, card_bytes(k3_card)), now=0.3)
    assert kinds(events) == ["InstanceRemoved", "ModelRemoved", "InstanceAdded"]
    assert events[0] == InstanceRemoved("junk-1", instance("junk-1"), "evicted")  # confirmed last
    # junk coming back, or more junk, is refused: no churn
    assert kinds(registry.apply(announce("junk-1", 2, junk_cards[1]), now=0.4)) == ["CardRejected"]
    assert kinds(registry.apply(announce("junk-2", 1, junk_cards[2]), now=0.4)) == ["CardRejected"]
    assert registry.model_names() == ["junk-0", K3]
    # the model leaves with its workers: its card vouches for nobody any more
    registry.apply(withdraw("real", 2), now=0.5)
    assert kinds(registry.apply(withdraw("real-2", 3), now=0.5)) == ["InstanceRemoved", "ModelRemoved"]
    registry.expire(100.0)  # the tombstones go; junk-0 expires too
    for index in range(3):
        registry.apply(announce(f"junk-{index}", 3, junk_cards[index]), now=100.0)
        registry.confirm(f"junk-{index}")
    assert kinds(registry.apply(announce("real-3", 1, card_bytes(k3_card)), now=100.0)) == ["CardRejected"]


def test_a_newcomer_whose_endpoint_answered_a_probe_gets_into_a_table_full_of_served_junk(
    k3_card: ModelDeploymentCard,
) -> None:
    """A worker of a brand-new model has no model in use to vouch for it: the watcher probes its
    endpoint, and once it answered (``note_proven``) it gets in like a scale-up, and stays."""
    registry = DiscoveryRegistry(max_instances=2)
    junk_cards = [card_bytes(msgspec.structs.replace(k3_card, display_name=f"junk-{i}")) for i in range(3)]
    for index in range(2):
        registry.apply(announce(f"junk-{index}", 1, junk_cards[index]), now=0.0)
        registry.confirm(f"junk-{index}")
    assert kinds(registry.apply(announce("new", 1, card_bytes(k3_card)), now=0.1)) == ["CardRejected"]
    registry.note_proven("new")
    events = registry.apply(announce("new", 2, card_bytes(k3_card)), now=0.2)
    assert kinds(events) == ["InstanceRemoved", "ModelRemoved", "ModelFirstSeen", "InstanceAdded"]
    assert events[0] == InstanceRemoved("junk-1", instance("junk-1"), "evicted")
    # unbuilt yet, it is still kept: junk coming back is refused
    assert kinds(registry.apply(announce("junk-1", 2, junk_cards[1]), now=0.3)) == ["CardRejected"]
    assert kinds(registry.apply(announce("junk-2", 1, junk_cards[2]), now=0.3)) == ["CardRejected"]
    assert registry.model_of("new") == K3


def test_a_model_holds_at_most_its_per_model_cap(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry(max_instances_per_model=2)
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 1, raw), now=0.0)
    registry.apply(announce("b", 1, raw), now=0.0)
    events = registry.apply(announce("c", 1, raw), now=0.0)
    assert [event.reason for event in events if isinstance(event, CardRejected)] == [
        "too_many_instances_of_model"
    ]
    registry.apply(withdraw("a", 2), now=0.1)
    assert kinds(registry.apply(announce("c", 2, raw), now=0.2)) == ["InstanceAdded"]


def test_runtime_config_defaults_compare_equal(k3_card: ModelDeploymentCard) -> None:
    explicit = msgspec.structs.replace(k3_card, runtime_config=ModelRuntimeConfig(data_parallel_size=1))
    registry = DiscoveryRegistry()
    registry.apply(announce("a", 1, card_bytes(k3_card)), now=0.0)
    assert kinds(registry.apply(announce("b", 1, card_bytes(explicit)), now=0.0)) == ["InstanceAdded"]


def test_a_forged_huge_seq_cannot_lock_the_real_sender_out(k3_card: ModelDeploymentCard) -> None:
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 100, raw), now=0.0)
    forged = announce("a", 2**64 - 1, raw, ttl_ms=600_000, endpoint="tcp://10.6.6.6:1")
    events = registry.apply(forged, now=0.1)
    assert kinds(events) == ["CardRejected"] and events[0].reason == "seq_jump"  # type: ignore[union-attr]
    snapshot = registry.model(K3)
    assert snapshot is not None and snapshot.instances["a"].endpoint == ENDPOINT
    assert registry.apply(announce("a", 101, raw), now=0.2) == []  # the worker goes on as before


def test_a_huge_seq_first_seen_is_replaced_by_the_real_senders_next_announce(
    k3_card: ModelDeploymentCard,
) -> None:
    """A frontend that starts after the forgery saw no earlier seq: the real sender's far lower seq
    restarts the sequence instead of being dropped as stale for the forger's TTL."""
    registry = DiscoveryRegistry()
    raw = card_bytes(k3_card)
    registry.apply(announce("a", 2**64 - 1, raw, ttl_ms=600_000, endpoint="tcp://10.6.6.6:1"), now=0.0)
    events = registry.apply(announce("a", 7, raw), now=0.5)
    assert events == [InstanceAdded(K3, instance("a"), k3_card.mdcsum())]
    assert registry.counters["seq_restart"] == 1
    assert registry.apply(announce("a", 6, raw), now=0.6) == []  # ordinary staleness still holds
