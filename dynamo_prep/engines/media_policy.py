"""Where a worker may fetch request images from: hosts, addresses, and how they are spelled.

Pure and light (no HTTP client): the worker's options build a ``MediaPolicy``; the image fetcher
asks it about every URL, every redirect target and every address it is about to connect to.
docs/engines.md ("Fetching images safely") has the rules and why.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["Address", "MediaPolicy", "Network", "numeric_addresses"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# NAT64's well-known prefix: the gateway connects to the IPv4 address in the last 32 bits.
_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")
_LABEL: Final = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME: Final = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*")


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """``allowed_domains``: the only host names images may come from (None: any); an exact match,
    as vLLM's ``--allowed-media-domains``. ``allowed_networks``: addresses that are not public and
    may still be fetched from (the default, none: only globally reachable addresses)."""

    allowed_domains: frozenset[str] | None = None
    allowed_networks: tuple[Network, ...] = ()

    @classmethod
    def from_options(cls, domains: Sequence[str] | None, networks: Sequence[str] = ()) -> MediaPolicy:
        """Raises ValueError naming the worker flag whose value is wrong."""
        allowed = None if domains is None else frozenset(_domain(value) for value in domains)
        if allowed is not None and not allowed:
            raise ValueError("--allowed-media-domains needs at least one domain")
        return cls(allowed, tuple(_network(value) for value in networks))

    def host_refusal(self, host: str) -> str | None:
        """Why a URL's host may not be fetched from (the allow-list), or None."""
        if self.allowed_domains is None or normal_host(host) in self.allowed_domains:
            return None
        return f"the host {host!r} is not one of the worker's allowed media domains"

    def address_refusal(self, address: Address) -> str | None:
        """Why ``address`` may not be connected to, or None: it must be a public unicast address, or
        one in ``allowed_networks``; an IPv4 address carried in IPv6 is judged as itself."""
        if isinstance(address, ipaddress.IPv6Address):
            carried = address.ipv4_mapped or (
                ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF) if address in _NAT64 else None
            )
            if carried is not None:
                return self.address_refusal(carried)
            if address.sixtofour is not None and self.address_refusal(address.sixtofour) is not None:
                return f"{address} carries a refused IPv4 address ({address.sixtofour})"
        if address.is_unspecified or address.is_multicast:
            return f"{address} is not a unicast address"
        if any(address in network for network in self.allowed_networks):
            return None
        if address.is_global and not address.is_reserved:
            return None
        return f"{address} is not a public address (see --allowed-media-networks)"


def numeric_addresses(host: str) -> list[Address] | None:
    """The addresses a numeric host stands for, as the C library reads it (``2130706433``,
    ``0x7f000001``, ``127.1``, ``::ffff:127.0.0.1``, ``fe80::1%eth0`` ...); None for a name."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    return _unique(ipaddress.ip_address(info[4][0]) for info in found)


def normal_host(host: str) -> str:
    """A host as the allow-list compares it: lower case, no trailing dot, no IPv6 brackets, ASCII."""
    host = host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        return host


def _unique(addresses: Iterable[Address]) -> list[Address]:
    return list(dict.fromkeys(addresses))


def _domain(value: str) -> str:
    host = normal_host(value)
    if _HOST_NAME.fullmatch(host) or numeric_addresses(host) is not None:
        return host
    raise ValueError(f"--allowed-media-domains: {value!r} is not a host name (no scheme, port or path)")


def _network(value: str) -> Network:
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ValueError(
            f"--allowed-media-networks: {value!r} is not a network (CIDR, e.g. 10.0.0.0/8 or fd00::/8)"
        ) from None
