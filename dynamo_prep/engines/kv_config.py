"""What a real engine's ``--kv-events-config`` publishes, as the address a frontend can connect to.

vLLM and SGLang take a similar JSON object (``publisher``, ``endpoint``, ``replay_endpoint``,
``topic``, plus buffer sizes we do not need) and build the same ZeroMQ publisher from it. Where
they differ, the reading follows each engine (vLLM 0.32-0.33, SGLang 0.5.23):

* Enabled: vLLM publishes only with ``enable_kv_cache_events: true`` (``publisher`` then defaults
  to ``"zmq"``). SGLang has no such key (it ignores it, like any unknown key): it publishes
  whenever ``publisher`` is ``"zmq"``, whose default there is ``"null"``. Any other publisher
  publishes nowhere we can follow.
* Data parallel rank ``r`` publishes on the configured ports plus ``r`` (``offset_endpoint_port``;
  SGLang's rank is the attention-DP rank under DP attention).
* The PUB binds when its address has ``*`` or ``::`` in it (SGLang: also ``0.0.0.0``), or is
  ``ipc://``; otherwise the engine *connects* to it, towards a relay, and there is nothing to
  subscribe to. SGLang's ``bind`` overrides that guess: ``true`` binds even a concrete host (which
  is then advertised as is), ``false`` connects. The replay ROUTER always binds. A wildcard host
  (``*``, ``0.0.0.0``, ``::``) is replaced by the worker's ``endpoint_host``: a frontend must
  connect to a concrete address. ``inproc://`` is not reachable from another process.
* SGLang's ``format`` is ``"default"`` or ``"dynamo"``: both send the same events; ``"dynamo"``
  namespaces block hashes by cache salt and LoRA (the same ids in stores, parent links and
  removals, so still opaque ids we can follow). Anything else is refused, as SGLang refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec
import structlog

from dynamo_prep.engines.bridge import KvDialect
from dynamo_prep.engines.registry import bridge
from dynamo_prep.protocol.discovery import KvEventsEndpoint

__all__ = ["WILDCARD_HOSTS", "kv_events_endpoint"]

log = structlog.get_logger("dynamo_prep.engines")

WILDCARD_HOSTS: Final = frozenset({"*", "0.0.0.0", "::", "[::]"})
_MAX_PORT: Final = 65535


class _KvEventsConfig(msgspec.Struct, kw_only=True):
    """The fields of vLLM's / SGLang's ``KVEventsConfig`` that say where events go (others ignored)."""

    enable_kv_cache_events: bool | None = None  # vLLM only
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None  # SGLang only
    replay_endpoint: str | None = None
    topic: str = ""
    format: str = "default"  # SGLang only


class _NotAdvertisedError(Exception):
    """An address no frontend can connect to; ``reason`` is a stable label for the log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def kv_events_endpoint(
    config: Mapping[str, Any] | str | object,
    *,
    flavor: str,
    endpoint_host: str,
    data_parallel_rank: int = 0,
) -> KvEventsEndpoint | None:
    """The announce's ``kv_events`` for an engine started with ``config``, or None (logged why).

    ``config`` is the ``--kv-events-config`` value as a dict, as its JSON text, or as the engine's
    own config object (read by attribute), read in the dialect of the engine called ``flavor``
    (``EngineBridge.kv_dialect``). Raises ValueError for a config the engine itself would refuse
    (not an object, wrong field types, a ``format`` it does not take, a port that is not a number
    where an offset applies) or an engine without such a config.
    """
    if data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
    dialect = _dialect(flavor)
    parsed = _parse(config, dialect)
    enabled = not dialect.needs_enable or parsed.enable_kv_cache_events is True
    publisher = parsed.publisher or ("zmq" if dialect.needs_enable and enabled else "null")
    fields = {"flavor": flavor, "endpoint": parsed.endpoint, "data_parallel_rank": data_parallel_rank}
    if not enabled or publisher == "null":
        log.info("kv_events_not_advertised", reason="disabled", publisher=publisher, **fields)
        return None
    if publisher != "zmq":
        log.warning("kv_events_not_advertised", reason="publisher_not_zmq", publisher=publisher, **fields)
        return None
    endpoint = _offset(parsed.endpoint, data_parallel_rank)
    replay = _offset(parsed.replay_endpoint, data_parallel_rank)
    try:
        advertised = _pub_address(endpoint, endpoint_host, binds=_binds(endpoint, parsed.bind, dialect))
    except _NotAdvertisedError as refused:
        log.warning("kv_events_not_advertised", reason=refused.reason, **fields)
        return None
    result = KvEventsEndpoint(
        endpoint=advertised, replay_endpoint=_replay_address(replay, endpoint_host), topic=parsed.topic
    )
    log.info(
        "kv_events_advertised",
        flavor=flavor,
        endpoint=result.endpoint,
        replay_endpoint=result.replay_endpoint,
        topic=result.topic,
        data_parallel_rank=data_parallel_rank,
    )
    return result


def _dialect(flavor: str) -> KvDialect:
    dialect = bridge(flavor).kv_dialect
    if dialect is None:
        raise ValueError(f"--engine {flavor} takes no --kv-events-config")
    return dialect


def _parse(config: Mapping[str, Any] | str | object, dialect: KvDialect) -> _KvEventsConfig:
    try:
        if isinstance(config, str | bytes):
            parsed = msgspec.json.decode(config, type=_KvEventsConfig)
        elif isinstance(config, Mapping):
            parsed = msgspec.convert(dict(config), _KvEventsConfig)
        else:
            parsed = msgspec.convert(config, _KvEventsConfig, from_attributes=True)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"kv_events_config: {exc}") from None
    if dialect.formats is not None and parsed.format not in dialect.formats:
        accepted = ", ".join(repr(name) for name in dialect.formats)
        raise ValueError(f"kv_events_config: format must be one of {accepted}, got {parsed.format!r}")
    return parsed


def _offset(endpoint: str | None, rank: int) -> str | None:
    """The engines' ``offset_endpoint_port``: rank ``r`` uses port + ``r`` (``inproc``: a suffix)."""
    if not endpoint or not rank:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" not in endpoint:
        raise ValueError(f"kv_events_config: {endpoint!r} cannot be offset by a data parallel rank")
    if ":" not in endpoint:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"kv_events_config: the port of {endpoint!r} is not a number")
    return f"{base}:{int(port) + rank}"


def _binds(endpoint: str | None, bind: bool | None, dialect: KvDialect) -> bool:
    """Whether the engine binds its PUB to ``endpoint`` (else it connects)."""
    if dialect.honours_bind and bind is not None:
        return bind
    if not endpoint:
        return False
    local = endpoint.startswith(("ipc://", "inproc://"))
    return local or any(mark in endpoint for mark in dialect.bind_marks)


def _pub_address(endpoint: str | None, endpoint_host: str, *, binds: bool) -> str:
    if not endpoint:
        raise _NotAdvertisedError("no_endpoint")
    if endpoint.startswith("inproc://"):
        raise _NotAdvertisedError("inproc")
    if not binds:
        raise _NotAdvertisedError("publisher_connects")
    if endpoint.startswith("ipc://"):
        return endpoint
    return _tcp_address(endpoint, endpoint_host)


def _replay_address(endpoint: str | None, endpoint_host: str) -> str | None:
    """The ROUTER's address (it always binds); None, logged, when it cannot be reached."""
    if endpoint is None or endpoint.startswith("ipc://"):
        return endpoint
    try:
        if endpoint.startswith("inproc://"):
            raise _NotAdvertisedError("inproc")
        return _tcp_address(endpoint, endpoint_host)
    except _NotAdvertisedError as refused:
        log.warning("kv_replay_not_advertised", reason=refused.reason, replay_endpoint=endpoint)
        return None


def _tcp_address(endpoint: str, endpoint_host: str) -> str:
    """``tcp://HOST:PORT`` with a wildcard host replaced; the port must be a concrete number."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        raise _NotAdvertisedError("unsupported_transport")
    host, _, port = rest.rpartition(":")
    if not port.isdigit() or not 0 < int(port) <= _MAX_PORT:
        raise _NotAdvertisedError("no_port")
    if host in WILDCARD_HOSTS:
        bare_ipv6 = ":" in endpoint_host and not endpoint_host.startswith("[")
        host = f"[{endpoint_host}]" if bare_ipv6 else endpoint_host
    return f"tcp://{host}:{port}"
