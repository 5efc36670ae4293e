"""The image fetcher's HTTP client: every connection goes to an address the ``MediaPolicy`` allows.

A host is resolved once per connection (a numeric host is read as the C library reads it, never
looked up), every address it resolves to is checked, and the connection is made to a checked
address: no second lookup can answer something else. The Host header, TLS SNI and certificate
checks keep the URL's name. No proxy is used (a proxy would resolve the name itself, past the check).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Final, Literal

import httpcore
import httpx

from dynamo_prep.engines.media_policy import Address, MediaPolicy, numeric_addresses

__all__ = ["FetchRefusedError", "Resolve", "checked_client"]

Resolve = Callable[[str, int], Awaitable[Sequence[Address]]]
"""A host name's addresses (``socket.gaierror`` or another ``OSError`` when it has none)."""

_HEADERS: Final = {"accept": "image/*, */*;q=0.5", "accept-encoding": "identity", "user-agent": "dynamo-prep"}


class FetchRefusedError(Exception):
    """A connection the policy refused, or a host that could not be resolved."""

    def __init__(self, reason: Literal["address_refused", "resolve_failed"], detail: str) -> None:
        super().__init__(detail)
        self.reason: Literal["address_refused", "resolve_failed"] = reason


def checked_client(
    policy: MediaPolicy, max_connections: int, timeout_s: float, resolve: Resolve | None = None
) -> httpx.AsyncClient:
    """An HTTP client that follows no redirect, keeps no cookie, uses no proxy and connects only to
    addresses ``policy`` allows (``resolve``: the lookup; the default is the C library's, in
    ``max_connections`` threads of its own, closed with the client)."""
    lookups = None
    if resolve is None:
        lookups = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="image-dns")
        resolve = functools.partial(_resolve, lookups)
    transport = httpx.AsyncHTTPTransport(trust_env=False)
    # httpx takes no network backend; its transport's pool is replaced by one with the checked backend
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(trust_env=False),
        max_connections=max_connections,
        network_backend=_CheckedBackend(policy, resolve),
    )
    client = _Client(
        transport=transport,
        timeout=timeout_s,
        follow_redirects=False,  # followed by hand: counted, bodies unread, every target checked
        headers=_HEADERS,
        # no cookie is ever kept: one request's cookies must not reach another's fetch
        cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
        trust_env=False,
    )
    client.lookups = lookups
    return client


class _Client(httpx.AsyncClient):
    lookups: ThreadPoolExecutor | None = None

    async def aclose(self) -> None:
        await super().aclose()
        if self.lookups is not None:  # a lookup still running ends on its own; nothing waits for it
            self.lookups.shutdown(wait=False, cancel_futures=True)


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """anyio's backend behind the policy: resolve, check every address, connect to a checked one."""

    def __init__(self, policy: MediaPolicy, resolve: Resolve) -> None:
        self._policy = policy
        self._resolve = resolve
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        failed: Exception | None = None
        for address in await self._addresses(host, port):
            try:
                return await self._backend.connect_tcp(
                    str(address), port, timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc  # the next checked address, as a resolver's answers are tried in turn
        assert failed is not None
        raise failed

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise FetchRefusedError("address_refused", "a unix socket is never connected to")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)

    async def _addresses(self, host: str, port: int) -> Sequence[Address]:
        """Every address of ``host``, each allowed by the policy (else nothing is connected to)."""
        addresses = numeric_addresses(host)
        if addresses is None:
            try:
                addresses = list(await self._resolve(host, port))
            except OSError as exc:
                raise FetchRefusedError("resolve_failed", f"{host!r} could not be resolved: {exc}") from None
        if not addresses:
            raise FetchRefusedError("resolve_failed", f"{host!r} has no address")
        for address in addresses:
            refused = self._policy.address_refusal(address)
            if refused is not None:
                raise FetchRefusedError("address_refused", f"{host!r}: {refused}")
        return addresses


async def _resolve(lookups: ThreadPoolExecutor, host: str, port: int) -> list[Address]:
    lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    found = await asyncio.get_running_loop().run_in_executor(lookups, lookup)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in found))
