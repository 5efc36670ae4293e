"""Which KV-event endpoints the frontend follows, and for which instance.

Two rules (docs/kv-events.md, "Whose endpoint"): a KV endpoint (or replay endpoint) serves one
instance, the first that claimed it; and it is on the announcing worker's own host (the host of
its request-plane endpoint) unless the operator allows its host (``--kv-endpoint-hosts``, ``*``
for any). Addresses are compared in one spelling: lower-case names, canonical IP addresses, the
port as a number, and every address of this machine (loopback, ``localhost``, a wildcard,
``ipc://``) as one host.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Literal

from dynamo_prep.protocol.discovery import Instance

__all__ = ["ANY_HOST", "KvEndpointRules", "Refusal", "address_key", "host_of"]

ANY_HOST = "*"
_LOCAL = "local"  # this machine, however it is spelt
_LOCAL_NAMES = frozenset({"localhost", "*", "0.0.0.0", "::"})
_LOCAL_SCHEMES = frozenset({"ipc", "inproc"})
_HOSTED_SCHEMES = frozenset({"tcp", "ws", "wss"})

Refusal = Literal["endpoint_in_use", "foreign_host"]


def _host(raw: str) -> str:
    name = raw.strip("[]").lower().rstrip(".")
    if name in _LOCAL_NAMES:
        return _LOCAL
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return _LOCAL if address.is_loopback or address.is_unspecified else str(address)


def _split(address: str) -> tuple[str, str, str]:
    """(scheme, host, rest) of ``scheme://host:port`` (``ipc``: this machine, rest the path; a
    transport without hosts we know, ``tipc`` say: no host, ``""``)."""
    scheme, _, rest = address.partition("://")
    scheme = scheme.lower()
    if scheme in _LOCAL_SCHEMES:
        return scheme, _LOCAL, rest
    if scheme not in _HOSTED_SCHEMES:
        return scheme, "", rest
    host, _, port = rest.rpartition(":")
    return scheme, _host(host), str(int(port)) if port.isdigit() else port


def host_of(address: str) -> str:
    """The host an address reaches, in the one spelling the rules compare."""
    return _split(address)[1]


def address_key(address: str) -> str:
    """The address in the one spelling the rules compare (two spellings of one socket, one key)."""
    scheme, host, rest = _split(address)
    return f"{scheme}://{host}/{rest}"


class KvEndpointRules:
    """The claims on KV endpoints of the instances followed, and the hosts allowed beyond their own."""

    def __init__(self, allowed_hosts: Iterable[str] = ()) -> None:
        hosts = set(allowed_hosts)
        self.any_host = ANY_HOST in hosts
        self.allowed_hosts = frozenset(_host(host) for host in hosts - {ANY_HOST})
        self._owners: dict[str, str] = {}  # address key -> instance_id
        self._claims: dict[str, tuple[str, ...]] = {}  # instance_id -> its address keys

    def refusal(self, instance: Instance) -> tuple[Refusal, str] | None:
        """Why ``instance`` may not be followed at its KV addresses (None: it may)."""
        kv = instance.kv_events
        if kv is None:
            return None
        own = host_of(instance.endpoint)
        for address in _addresses(instance):
            host = host_of(address)
            if host != own and not self.any_host and host not in self.allowed_hosts:
                return "foreign_host", f"{address} is not on the host of {instance.endpoint}"
            owner = self._owners.get(address_key(address))
            if owner is not None and owner != instance.instance_id:
                return "endpoint_in_use", f"{address} is followed for instance {owner}"
        return None

    def claim(self, instance: Instance) -> None:
        """``instance`` is followed at its addresses (``refusal`` said it may be)."""
        self.release(instance.instance_id)
        keys = tuple(address_key(address) for address in _addresses(instance))
        for key in keys:
            self._owners[key] = instance.instance_id
        self._claims[instance.instance_id] = keys

    def release(self, instance_id: str) -> None:
        for key in self._claims.pop(instance_id, ()):
            if self._owners.get(key) == instance_id:
                del self._owners[key]


def _addresses(instance: Instance) -> tuple[str, ...]:
    kv = instance.kv_events
    if kv is None:
        return ()
    return (kv.endpoint,) if kv.replay_endpoint is None else (kv.endpoint, kv.replay_endpoint)
