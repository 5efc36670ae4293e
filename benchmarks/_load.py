"""A cheap HTTP/1.1 load generator: keep-alive connections, pre-encoded requests, httptools' parser.

The HTTP suite measures the frontend, not its client: httpx spends about 1.5 ms of CPU per request,
as much as the frontend it measures, on the same two cores. Here a request is one ``write`` of bytes
built once, and the response (``Content-Length`` or chunked, as SSE is) is parsed by httptools' C
parser; the body is kept whole so the caller can check it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httptools

__all__ = ["Connection", "HttpError", "encode_post"]


class HttpError(Exception):
    """The server answered with another status than 200, or the connection broke."""


def encode_post(path: str, body: dict[str, Any], host: str = "127.0.0.1") -> bytes:
    """A complete keep-alive ``POST`` of ``body`` as JSON."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


class Connection(asyncio.Protocol):
    """One keep-alive connection; ``request`` sends one request and returns the whole body.

    ``first_body_at`` is when the last request's first body bytes arrived (``time.perf_counter``):
    a stream's time to first event."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiting: asyncio.Future[bytes] | None = None
        self._body: list[bytes] = []
        self.first_body_at: float | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(cls, host, port)
        return connection

    async def request(self, raw: bytes) -> bytes:
        if self._transport is None or self._transport.is_closing():
            raise HttpError("connection closed")
        self._waiting = asyncio.get_running_loop().create_future()
        self._body = []
        self.first_body_at = None
        self._transport.write(raw)
        return await self._waiting

    @property
    def open_(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpError(f"bad response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(HttpError(f"connection lost: {exc}"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        if self.first_body_at is None:
            self.first_body_at = time.perf_counter()
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        body = b"".join(self._body)
        if status != 200:
            self._fail(HttpError(f"HTTP {status}: {body[:200]!r}"))
        elif self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(body)

    def _fail(self, error: HttpError) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_exception(error)
