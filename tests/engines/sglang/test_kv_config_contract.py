"""Our reading of ``--kv-events-config`` against SGLang's own (SGLang 0.5.23; ``make test-engines``).

SGLang's real ``KVEventsConfig`` parses every JSON text ``kv_events_endpoint`` accepts for
``flavor="sglang"`` and refuses the ``format`` values we refuse; the fields we read are SGLang's,
with SGLang's defaults. The publisher SGLang builds from the same text (``EventPublisherFactory``,
as its scheduler does) binds what we advertise: its ``describe_local_source`` reports the bound
address (a wildcard as loopback, so we advertise with ``endpoint_host="127.0.0.1"``), and None
when its PUB connects or nothing publishes. A batch that publisher sends, with ``"dynamo"``-format
block hashes, decodes with ``decode_batch`` live and through replay. SGLang is imported inside the
tests (only this venv has it).
"""

from __future__ import annotations

import atexit
import importlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, get_args

import msgspec
import pytest
import zmq
from support.plane import free_port

from dynamo_prep.engines.kv_config import _KvEventsConfig, kv_events_endpoint
from dynamo_prep.engines.sglang.bridge import FORMATS as SGLANG_FORMATS
from dynamo_prep.protocol.discovery import KvEventsEndpoint
from dynamo_prep.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_live,
    parse_replay,
    replay_request,
)

LOOPBACK = "127.0.0.1"
PAGE = 16
TIMEOUT_S = 20.0
# Configs as an operator writes them: ``{port}`` / ``{replay}`` are free ports (already offset by
# the rank under test), ``{ipc}`` a socket path.
CONFIGS: dict[str, dict[str, Any]] = {
    "wildcard": {"publisher": "zmq", "endpoint": "tcp://*:{port}", "replay_endpoint": "tcp://*:{replay}"},
    "all-interfaces": {"publisher": "zmq", "endpoint": "tcp://0.0.0.0:{port}", "topic": "kv"},
    "bind-loopback": {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", "bind": True},
    "bind-wildcard": {"publisher": "zmq", "endpoint": "tcp://*:{port}", "bind": True, "topic": "t"},
    "connect-loopback": {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}"},
    "connect-explicit": {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", "bind": False},
    "enable-key-ignored": {"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:{port}"},
    "dynamo-format": {"publisher": "zmq", "endpoint": "tcp://*:{port}", "format": "dynamo"},
    "default-format": {"publisher": "zmq", "endpoint": "tcp://*:{port}", "format": "default"},
    "unknown-keys": {"publisher": "zmq", "endpoint": "tcp://*:{port}", "later": {"x": 1}, "hwm": 10},
    "null-publisher": {"publisher": "null", "endpoint": "tcp://*:{port}"},
    "no-publisher": {"enable_kv_cache_events": True, "endpoint": "tcp://*:{port}"},
    "ipc": {"publisher": "zmq", "endpoint": "ipc://{ipc}"},
    "inproc": {"publisher": "zmq", "endpoint": "inproc://kv-{port}"},
}
NOTHING_PUBLISHED = ("null-publisher", "no-publisher")  # publisher "null", given or by default


@pytest.fixture(scope="module")
def sglang_kv() -> ModuleType:
    """SGLang's ``sglang.srt.disaggregation.kv_events``: its config, publisher and event structs."""
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def config_text(name: str, rank: int, ipc_dir: Path) -> str:
    """``CONFIGS[name]`` as JSON with ports that are free once offset by ``rank``."""
    text = json.dumps(CONFIGS[name])
    for key, value in {
        "port": free_port() - rank,
        "replay": free_port() - rank,
        "ipc": ipc_dir / "kv.sock",
    }.items():
        text = text.replace(f"{{{key}}}", str(value))
    return text


def ours(text: str, rank: int = 0) -> KvEventsEndpoint | None:
    return kv_events_endpoint(text, flavor="sglang", endpoint_host=LOOPBACK, data_parallel_rank=rank)


def test_the_fields_we_read_are_sglangs_with_sglangs_defaults(sglang_kv: ModuleType) -> None:
    theirs = sglang_kv.KVEventsConfig.model_fields
    for field in msgspec.structs.fields(_KvEventsConfig):
        if field.name == "enable_kv_cache_events":  # vLLM's switch: SGLang has none
            assert field.name not in theirs
            continue
        assert field.name in theirs, field.name
        # Our publisher default is None ("absent"), which we read as SGLang's default.
        default = theirs[field.name].default if field.name != "publisher" else None
        assert field.default == default, field.name
    assert get_args(theirs["format"].annotation) == SGLANG_FORMATS
    assert sglang_kv.KVEventsConfig.from_cli("{}").publisher == "null"
    assert ours("{}") is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sglang_parses_what_we_accept_to_the_same_values(
    name: str, sglang_kv: ModuleType, tmp_path: Path
) -> None:
    text = config_text(name, 0, tmp_path)
    theirs = sglang_kv.KVEventsConfig.from_cli(text)
    parsed = msgspec.json.decode(text, type=_KvEventsConfig)
    for field in ("endpoint", "bind", "replay_endpoint", "topic", "format"):
        assert getattr(theirs, field) == getattr(parsed, field), field
    assert theirs.publisher == (parsed.publisher or "null")
    # SGLang's own config object, read by attribute, is read as its JSON text.
    assert kv_events_endpoint(theirs, flavor="sglang", endpoint_host=LOOPBACK) == ours(text)


@pytest.mark.parametrize("hash_format", ["raw", "Dynamo", "", 1])
def test_a_format_sglang_refuses_we_refuse(hash_format: Any, sglang_kv: ModuleType) -> None:
    text = json.dumps({"publisher": "zmq", "format": hash_format})
    with pytest.raises(ValueError, match="format"):
        sglang_kv.KVEventsConfig.from_cli(text)  # pydantic's ValidationError is a ValueError
    with pytest.raises(ValueError, match="format"):
        ours(text)


@pytest.fixture
def publisher_of(sglang_kv: ModuleType) -> Iterator[Callable[[str, int], Any]]:
    """SGLang's publisher for a config text and rank, built as its scheduler builds it."""
    built: list[Any] = []

    def build(text: str, rank: int) -> Any:
        publisher = sglang_kv.EventPublisherFactory.create(text, attn_dp_rank=rank)
        built.append(publisher)
        return publisher

    yield build
    for publisher in built:
        publisher.shutdown()
        atexit.unregister(publisher.shutdown)  # else each one waits a second at exit


@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sglangs_publisher_binds_what_we_advertise(
    name: str, rank: int, publisher_of: Callable[[str, int], Any], tmp_path: Path
) -> None:
    text = config_text(name, rank, tmp_path)
    if name == "ipc" and rank:  # neither engine can offset an ipc:// address by a rank
        with pytest.raises(ValueError):
            publisher_of(text, rank)
        with pytest.raises(ValueError, match="offset"):
            ours(text, rank)
        return
    if name in NOTHING_PUBLISHED:
        # SGLang 0.5.23 passes the config to NullEventPublisher, which takes no arguments: its
        # scheduler does not start. Nothing is published either way, and we advertise nothing.
        with pytest.raises(TypeError):
            publisher_of(text, rank)
        assert ours(text, rank) is None
        return
    source = publisher_of(text, rank).describe_local_source(PAGE)
    found = ours(text, rank)
    if source is None:
        assert found is None
        return
    assert source["dp_rank"] == rank
    assert found == KvEventsEndpoint(
        endpoint=source["endpoint"], replay_endpoint=source.get("replay_endpoint"), topic=source["topic"]
    )


def sglang_events(sglang_kv: ModuleType) -> list[Any]:
    """A chained store, an eviction and a clear, hashed as the ``"dynamo"`` format hashes them."""
    seed = sglang_kv.kv_event_namespace_seed(extra_key="lora-extra", cache_salt="salt")
    first, second = (sglang_kv.namespaced_block_hash(h, namespace_seed=seed) for h in (11, -12))
    stored = sglang_kv.BlockStored(
        block_hashes=[first, second],
        parent_block_hash=None,
        token_ids=list(range(2 * PAGE)),
        block_size=PAGE,
        lora_id=None,
        medium=sglang_kv.StorageMedium.GPU,
        cache_salt="salt",
        session_id="session-1",
        lora_name="adapter",
    )
    chained = sglang_kv.BlockStored(
        block_hashes=[7], parent_block_hash=second, token_ids=[1] * PAGE, block_size=PAGE, lora_id=None
    )
    removed = sglang_kv.BlockRemoved(block_hashes=[second, 7], medium=sglang_kv.StorageMedium.CPU)
    return [stored, chained, removed, sglang_kv.AllBlocksCleared()]


def assert_decodes_as_sent(payload: bytes, sent: list[Any], rank: int) -> None:
    decoded = decode_batch(payload)
    assert decoded.skipped == [] and decoded.batch.data_parallel_rank == rank
    stored, chained, removed, cleared = decoded.batch.events
    assert isinstance(stored, BlockStored) and isinstance(chained, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash) == (sent[0].block_hashes, None)
    assert (stored.token_ids, stored.block_size, stored.medium) == (sent[0].token_ids, PAGE, "GPU")
    assert (stored.lora_name, stored.session_id) == ("adapter", "session-1")
    assert (chained.block_hashes, chained.parent_block_hash) == ([7], sent[0].block_hashes[-1])
    assert isinstance(removed, BlockRemoved) and (removed.block_hashes, removed.medium) == (
        sent[2].block_hashes,
        "CPU_PINNED",
    )
    assert isinstance(cleared, AllBlocksCleared)


def test_a_batch_sglangs_publisher_sends_decodes_with_ours(
    sglang_kv: ModuleType, publisher_of: Callable[[str, int], Any], tmp_path: Path
) -> None:
    rank = 1
    text = json.dumps(
        {**json.loads(config_text("wildcard", rank, tmp_path)), "topic": "kv", "format": "dynamo"}
    )
    publisher = publisher_of(text, rank)
    found = ours(text, rank)
    assert found is not None and found.replay_endpoint is not None
    events = sglang_events(sglang_kv)
    context = zmq.Context.instance()
    with context.socket(zmq.SUB) as sub, context.socket(zmq.DEALER) as dealer:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(found.endpoint)
        deadline = time.monotonic() + TIMEOUT_S
        while not sub.poll(100):  # a SUB hears only what is sent after it joined
            assert time.monotonic() < deadline, "nothing arrived on the advertised endpoint"
            publisher.publish(sglang_kv.KVEventBatch(ts=time.time(), events=events))
        topic, _, payload = parse_live(sub.recv_multipart())
        assert topic == b"kv"
        assert_decodes_as_sent(payload, events, rank)
        dealer.connect(found.replay_endpoint)
        dealer.send_multipart(replay_request(0))
        assert dealer.poll(int(TIMEOUT_S * 1000)), "no replay from the advertised replay endpoint"
        first = parse_replay(dealer.recv_multipart())
        assert first.seq == 0 and not first.end
        assert_decodes_as_sent(first.payload, events, rank)
