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
at once instead of queueing behind them. The body's own deadline is the app's (``api/common.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httptools
import msgspec
import structlog
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamo_prep.frontend.config import DEFAULT_HEADER_TIMEOUT_S, HttpSettings
from dynamo_prep.frontend.errors import OpenAIError
from dynamo_prep.lifecycle import new_event_loop
from dynamo_prep.logging import RateLimiter

if TYPE_CHECKING:
    from dynamo_prep.frontend.metrics import FrontendMetrics

__all__ = [
    "GRACE_S",
    "KEEP_ALIVE_S",
    "PROBE_PATHS",
    "PROBE_RESERVE",
    "ConnectionTable",
    "HttpServer",
    "bind_http",
    "new_event_loop",
]

log = structlog.get_logger("dynamo_prep.frontend")

GRACE_S = 5.0
KEEP_ALIVE_S = 5
# Past --http-max-connections with nobody idle, this many more connections may still ask for the
# probes (a kubelet's /live must get through a flood of busy connections); others get 503.
PROBE_RESERVE = 64
PROBE_PATHS = ("/live", "/health")
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


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
_refusals = RateLimiter(interval_s=1.0)


# Writes of one loop step up to this size are joined into one send; larger ones go as they are.
CORK_JOIN_BYTES = 64 << 10


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
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self._transport.is_closing():
            return
        if sum(map(len, pending)) <= CORK_JOIN_BYTES:
            self._transport.write(b"".join(pending))
        else:  # a large body's pieces, as they are: joining them is a copy of the whole
            for data in pending:
                self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Guard:
    """What the connections of one server share: the limits, the connection table, the refusals'
    prepared answers, counters and (rate-limited) log lines."""

    def __init__(self, settings: HttpSettings, metrics: FrontendMetrics | None) -> None:
        self.settings = settings
        self.table = ConnectionTable(settings.max_connections, settings.max_client_connections)
        self._metrics = metrics
        self._answers = {
            reason: _answer(status, text) for reason, (status, text) in _reasons(settings).items()
        }

    def refusal(self, reason: str, client: Any) -> bytes:
        """Count and log one refusal; the complete HTTP answer to send before closing."""
        if self._metrics is not None:
            self._metrics.http_refused.labels(reason=reason).inc()
        suppressed = _refusals.allow(reason, time.monotonic())
        if suppressed is not None:
            log.info("http_request_refused", reason=reason, client=_peer(client), suppressed=suppressed)
        return self._answers[reason]

    def closed_idle(self, reason: str, client: Any) -> None:
        if self._metrics is not None:
            self._metrics.http_idle_closed.labels(reason=reason).inc()
        suppressed = _refusals.allow(f"idle:{reason}", time.monotonic())
        if suppressed is not None:
            log.info(
                "http_idle_connection_closed", reason=reason, client=_peer(client), suppressed=suppressed
            )


def _reasons(settings: HttpSettings) -> dict[str, tuple[int, str]]:
    return {
        "url_too_long": (414, f"the request URL is longer than {settings.max_url_bytes} bytes"),
        "header_too_large": (431, f"the request head is larger than {settings.max_header_bytes} bytes"),
        "too_many_headers": (431, f"the request has more than {settings.max_headers} headers"),
        "connection_limit": (503, f"{settings.max_connections} connections are open, none of them idle"),
        "client_connection_limit": (
            503,
            f"this client has {settings.max_client_connections} connections open, none of them idle",
        ),
        "probes_only": (503, f"at the connection limit only {' and '.join(PROBE_PATHS)} are served"),
    }


def _answer(status: int, message: str) -> bytes:
    body = msgspec.json.encode(OpenAIError(status, message).body())
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


class ConnectionTable:
    """Open connections by client address, and the idle ones oldest first: whom a newcomer displaces.

    At a client's cap its own longest idle connection is closed for the newcomer; at the server's
    cap, the longest idle one of anybody. With none idle the newcomer is refused, except for up to
    ``PROBE_RESERVE`` more connections that may only ask for ``PROBE_PATHS``. Every step is O(1).
    """

    def __init__(self, max_connections: int, max_client_connections: int) -> None:
        self.max_connections = max_connections
        self.max_client_connections = max_client_connections
        self._open: dict[_GuardedProtocol, str] = {}
        self._by_client: dict[str, int] = {}
        self._idle: dict[_GuardedProtocol, None] = {}  # insertion order: the longest idle first
        self._idle_by_client: dict[str, dict[_GuardedProtocol, None]] = {}

    @property
    def open(self) -> int:
        return len(self._open)

    @property
    def full(self) -> bool:
        return len(self._open) > self.max_connections

    def admit(self, conn: _GuardedProtocol, client: str) -> str | None:
        """Admit ``conn`` (idle) and None, or the reason it is refused."""
        crowded = self._by_client.get(client, 0) >= self.max_client_connections
        if crowded and not self._close_oldest(self._idle_by_client.get(client), "client_connection_limit"):
            return "client_connection_limit"
        if len(self._open) >= self.max_connections and not self._close_oldest(self._idle, "connection_limit"):
            if len(self._open) >= self.max_connections + PROBE_RESERVE:
                return "connection_limit"
            conn.probes_only = True
        self._open[conn] = client
        self._by_client[client] = self._by_client.get(client, 0) + 1
        self.idle(conn)
        return None

    def idle(self, conn: _GuardedProtocol) -> None:
        client = self._open.get(conn)
        if client is not None:
            self._idle[conn] = None
            self._idle_by_client.setdefault(client, {})[conn] = None

    def busy(self, conn: _GuardedProtocol) -> None:
        if conn in self._idle:
            del self._idle[conn]
            client = self._open[conn]
            idle = self._idle_by_client[client]
            del idle[conn]
            if not idle:
                del self._idle_by_client[client]

    def gone(self, conn: _GuardedProtocol) -> None:
        self.busy(conn)
        client = self._open.pop(conn, None)
        if client is not None:
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]

    def _close_oldest(self, idle: dict[_GuardedProtocol, None] | None, reason: str) -> bool:
        if not idle:
            return False
        victim = next(iter(idle))
        self.gone(victim)
        victim.close_idle(reason)
        return True


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under the ``_Guard``'s limits (request heads, connections), with
    a deadline for each request's headers, writing through a ``_CorkedTransport``.

    Head bytes are counted as they are parsed: the parser is fed at most one byte past the header
    limit while a head is open, so a refused head costs what was received up to the limit.
    """

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    guard: _Guard
    probes_only = False
    _header_timer: asyncio.TimerHandle | None = None
    _head: int | None = 0  # bytes of the request head so far; None from its end to the next request
    _url_bytes = 0
    _headers = 0
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
        refused = self.guard.table.admit(self, self.client[0] if self.client else "")
        if refused is not None:
            self._refuse(refused)
        else:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.table.gone(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.guard.table.busy(self)
        view = memoryview(data)
        while view and not self._refused:
            if self._head is None:  # a body
                super().data_received(view)  # type: ignore[arg-type] # the parser takes any buffer
                return
            limit = self.guard.settings.max_header_bytes
            room = limit - max(self._head - self._url_bytes, 0) + 1
            piece, view = view[:room], view[room:]
            self._head += len(piece)
            super().data_received(piece)  # type: ignore[arg-type]
            if self._head is not None and self._head - self._url_bytes > limit and not self._refused:
                self._refuse("header_too_large")

    def on_message_begin(self) -> None:
        if self._refused:
            return
        self._url_bytes = self._headers = 0
        super().on_message_begin()
        if self._header_timer is None:  # the next request on a kept-alive connection
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self.guard.settings.max_url_bytes:
            self._refuse("url_too_long")
        elif not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > self.guard.settings.max_headers:
            self._refuse("too_many_headers")
        elif not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head = None
        if self._refused:
            return
        if self.probes_only:  # admitted past the connection limit
            if not self.guard.table.full:
                self.probes_only = False
            elif self._path() not in PROBE_PATHS:
                self._refuse("probes_only")
                return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._head = 0
        if self._refused:
            return
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.pipeline:  # answered early
            self.guard.table.idle(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head == 0 and not self.pipeline and not self.transport.is_closing():
            self.guard.table.idle(self)

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # the rest of a refused head may not parse: it was answered already
            super().send_400_response(msg)

    def close_idle(self, reason: str) -> None:
        """Closed to make room for a newcomer (``ConnectionTable``)."""
        self.guard.closed_idle(reason, self.client)
        self._disarm()
        self.transport.close()

    def _refuse(self, reason: str) -> None:
        if self._refused:
            return
        self._refused = True
        self._disarm()
        answer = self.guard.refusal(reason, self.client)
        if self.cycle is None or self.cycle.response_complete:  # never inside a response body
            self.transport.write(answer)
        self.transport.close()

    def _path(self) -> str:
        path: bytes = httptools.parse_url(self.url).path
        return path.decode("latin-1")

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


def _protocol(settings: HttpSettings, metrics: FrontendMetrics | None) -> type[HttpToolsProtocol]:
    attributes = {"header_timeout_s": settings.header_timeout_s, "guard": _Guard(settings, metrics)}
    return type("GuardedProtocol", (_GuardedProtocol,), attributes)


class HttpServer:
    """Serve ``app`` on an already bound socket until cancelled."""

    def __init__(
        self,
        app: ASGIApp,
        sock: socket.socket,
        settings: HttpSettings | None = None,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        settings = settings or HttpSettings()
        self.socket = sock
        config = uvicorn.Config(
            app,
            http=_protocol(settings, metrics),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
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
