"""uvicorn (httptools parser, uvloop loop) as one supervised component of the frontend process.

Why this stack, with the numbers: docs/frontend.md. The listening socket is bound by the caller
before anything starts, so a busy port is a clean start-up error (uvicorn would ``sys.exit`` from
inside a task) and ``--http-port 0`` works (the real port is logged). uvicorn's own signal capture
is switched off: the frontend process owns SIGTERM / SIGINT and stops every component together.
Cancelling ``run`` shuts uvicorn down gracefully (in-flight responses get ``GRACE_S`` to finish)
instead of dropping connections.

Hostile clients: a connection has ``header_timeout_s`` to deliver a request's headers (from its
first byte, or from the connection when it says nothing), else it gets a 408 and is closed, so
slow-header clients (slowloris) cannot hold connections forever; idle keep-alive connections are
closed after ``KEEP_ALIVE_S``; past ``max_connections`` open connections new requests get a 503
at once instead of queueing behind them. The body's own deadline is the app's (``app.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamo_prep.frontend.config import HttpSettings
from dynamo_prep.logging import RateLimiter

__all__ = ["GRACE_S", "KEEP_ALIVE_S", "HttpServer", "bind_http", "new_event_loop"]

log = structlog.get_logger("dynamo_prep.frontend")

GRACE_S = 5.0
KEEP_ALIVE_S = 5
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The frontend's event loop: uvloop (libuv), cheaper per I/O event than asyncio's own."""
    import uvloop  # noqa: PLC0415 - the HTTP stack only where it runs

    return uvloop.new_event_loop()


def bind_http(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` is an IPv6 literal).

    ``reuse_port``: several processes listen on the same port and the kernel spreads connections
    over them (SO_REUSEPORT). Accepted connections inherit TCP_NODELAY: a response's headers and
    body are two writes, and Nagle would hold the second for the client's delayed ACK (40 ms).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The frontend process handles signals for every component; uvicorn must not."""
        yield


_timeouts = RateLimiter(interval_s=10.0)


class _CorkedTransport:
    """A connection's transport whose writes of one event-loop step leave in one ``send``: a
    response's headers and body (or the last SSE events and the chunked terminator) become one
    segment, one syscall and one wake-up of the client instead of two."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers, writing through
    a ``_CorkedTransport``."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # the next request on a kept-alive connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        suppressed = _timeouts.allow("header_timeout", time.monotonic())
        if suppressed is not None:
            log.info("http_header_timeout", client=_peer(self.client), suppressed=suppressed)
        if self.cycle is None or self.cycle.response_complete:  # never inside a response body
            self.transport.write(_TIMED_OUT)
        self.transport.close()


def _peer(client: Any) -> str | None:
    return f"{client[0]}:{client[1]}" if client else None


def _protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    return type("GuardedProtocol", (_GuardedProtocol,), {"header_timeout_s": header_timeout_s})


class HttpServer:
    """Serve ``app`` on an already bound socket until cancelled."""

    def __init__(self, app: ASGIApp, sock: socket.socket, settings: HttpSettings | None = None) -> None:
        settings = settings or HttpSettings()
        self.socket = sock
        config = uvicorn.Config(
            app,
            http=_protocol(settings.header_timeout_s),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
            limit_concurrency=settings.max_connections,
            timeout_graceful_shutdown=int(GRACE_S),
        )
        self._server = _Server(config)

    @property
    def port(self) -> int:
        port: int = self.socket.getsockname()[1]
        return port

    async def run(self) -> None:
        serving = asyncio.create_task(self._server.serve(sockets=[self.socket]), name="uvicorn")
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(serving, GRACE_S + 1)
            raise
        finally:
            self.socket.close()
