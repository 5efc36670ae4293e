"""Discovery wire contract v1: two frames, ``[topic, payload]``, MessagePack payloads.

Validation happens here, once: the watcher gets typed messages or a ``DiscoveryDecodeError`` whose
``reason`` is a stable label for metrics and logs. The card stays raw until someone needs it, so
a heartbeat costs one small decode.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

from dynamo_prep.protocol.decode import WireDecodeError, decoding

PROTOCOL_VERSION = 1
TOPIC_PREFIX = "dynamo_prep.v1.card."
DEFAULT_NAMESPACE = "dynamo"
# Where a frontend binds its embedded plane, and where a broker takes workers' (XSUB) and
# frontends' (XPUB) connections, unless told otherwise: this machine only. Reaching a plane from
# other hosts is a choice made with an explicit address (and CURVE keys, or a firewall).
DEFAULT_BIND = "tcp://127.0.0.1:7555"
DEFAULT_BROKER_XSUB = "tcp://127.0.0.1:7555"
DEFAULT_BROKER_XPUB = "tcp://127.0.0.1:7556"
_LOCAL_HOSTS = ("127.", "localhost", "[::1]", "::1")
OPEN_PLANE_HINT = "any process that reaches these addresses can announce models; configure CURVE keys"
DEFAULT_TTL_MS = 3000
DEFAULT_HEARTBEAT_S = 1.0
MAX_PAYLOAD_BYTES = 1 << 20

_T = TypeVar("_T")
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class DiscoveryDecodeError(WireDecodeError):
    """A discovery message that cannot be used; ``reason`` is a stable snake_case label."""


class KvEventsEndpoint(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, gc=False):
    """Where an instance's engine publishes its KV-cache events (the vLLM wire, ``kv_events.py``).

    Addresses are connectable (``tcp://host:port``), as the worker advertises them; ``replay_endpoint``
    is the engine's replay ROUTER (None: no replay, a gap drops the instance's blocks instead).
    """

    endpoint: _NonEmpty
    replay_endpoint: _NonEmpty | None = None
    topic: Annotated[str, msgspec.Meta(max_length=256)] = ""


# A load figure larger than any engine holds: a bound on what a worker's heartbeat may claim.
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]


class Load(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, gc=False):
    """What an instance's engine holds as its heartbeat leaves (docs/request-plane.md, "Busy, hung
    and dead"): ``unfinished`` requests, ``waiting`` of them without a token yet (queued or in
    prefill), and ``stalled_ms``, how long its engine has had work without making a step (0: it
    stepped within the last heartbeat, or has nothing to do)."""

    unfinished: _Count = 0
    waiting: _Count = 0
    stalled_ms: _Count = 0


class Announce(msgspec.Struct, kw_only=True, tag="announce", tag_field="kind"):
    """A worker instance is alive and serves ``card`` at ``endpoint`` (re-sent every heartbeat).

    ``kv_events`` and ``load`` are optional and left out of the payload when unset, so a worker
    without them sends exactly what wire v1 always had and older frontends ignore the keys.
    """

    v: int = PROTOCOL_VERSION
    instance_id: _NonEmpty
    seq: _NonNegative
    sent_ms: int
    ttl_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = DEFAULT_TTL_MS
    endpoint: _NonEmpty
    card: msgspec.Raw
    kv_events: KvEventsEndpoint | msgspec.UnsetType = msgspec.UNSET
    load: Load | msgspec.UnsetType = msgspec.UNSET


class Withdraw(msgspec.Struct, kw_only=True, tag="withdraw", tag_field="kind"):
    """A worker instance is going away (graceful stop)."""

    v: int = PROTOCOL_VERSION
    instance_id: _NonEmpty
    seq: _NonNegative
    sent_ms: int


DiscoveryMessage = Announce | Withdraw


# How logs, metrics and the watch table show an instance that declares no token.
CHECKPOINT_DEFAULT = "checkpoint default"


def declared_label(declared_token: str | None) -> str:
    """A declaration as people read it: the token, or ``checkpoint default`` for None."""
    return CHECKPOINT_DEFAULT if declared_token is None else declared_token


class Instance(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One live worker instance as the frontend knows it: the record every layer carries.

    ``declared_token`` is what the worker declared in its card (``image_placeholder_token``;
    None means it renders the checkpoint default). It is never the token a formatter writes:
    that is the formatter's ``rendered_token``. ``total_kv_blocks`` is its engine's KV capacity
    (its card's ``runtime_config``; None: not said), which the KV router weighs load against;
    ``max_num_seqs`` the requests its engine runs at once (None: not said), past which the
    instance is saturated.
    """

    instance_id: str
    endpoint: str
    declared_token: str | None = None
    kv_events: KvEventsEndpoint | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None


class _Header(msgspec.Struct):
    kind: str
    v: int = PROTOCOL_VERSION


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_message_decoder = msgspec.msgpack.Decoder(DiscoveryMessage)


def topic(namespace: str = DEFAULT_NAMESPACE) -> bytes:
    """The topic frame (also the subscription prefix) for a namespace."""
    return f"{TOPIC_PREFIX}{namespace}".encode()


def reachable_from_elsewhere(address: str) -> bool:
    """Whether a bound address takes connections from other hosts (anything but loopback, ipc, inproc)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return False
    host = rest.rsplit(":", 1)[0]
    return not host.startswith(_LOCAL_HOSTS)


def encode_message(message: DiscoveryMessage) -> bytes:
    """Payload frame of an announce or withdraw."""
    return _encoder.encode(message)


def decode_message(payload: bytes | memoryview) -> DiscoveryMessage:
    """Typed message, or ``DiscoveryDecodeError`` with reason ``too_large``, ``undecodable``,
    ``too_deep``, ``unsupported_version``, ``unknown_kind`` or ``invalid``."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DiscoveryDecodeError("too_large", f"{len(payload)} bytes > {MAX_PAYLOAD_BYTES}")
    header = _decode(_header_decoder, payload)
    if header.v != PROTOCOL_VERSION:
        raise DiscoveryDecodeError("unsupported_version", f"v={header.v}")
    if header.kind not in ("announce", "withdraw"):
        raise DiscoveryDecodeError("unknown_kind", f"kind={header.kind[:64]!r}")
    return _decode(_message_decoder, payload)


def _decode(decoder: msgspec.msgpack.Decoder[_T], payload: bytes | memoryview) -> _T:
    """One decode; every way it can fail is a ``DiscoveryDecodeError`` with a stable reason."""
    with decoding(DiscoveryDecodeError):
        return decoder.decode(payload)
