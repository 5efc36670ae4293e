"""Request images for tests: real encoded pictures, and real HTTP servers on loopback that serve them.

``ImageServer`` runs in the test's own event loop (fetcher tests): requests are counted on the
server side and gated routes wait for permits the test hands out, so every wait is on a condition,
never on time. ``served_images`` runs a threaded server beside a sync test whose workers are other
processes. Every server binds a loopback address only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import io
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from PIL import Image

from dynamo_prep.engines.media_policy import MediaPolicy

RED, GREEN, BLUE = (255, 0, 0), (0, 160, 0), (0, 0, 255)
CHUNK = b"\0" * 65536
# What a worker of the tests may fetch from: its loopback servers (by default it may not).
LOOPBACK = ("127.0.0.0/8", "::1/128")
LOOPBACK_POLICY = MediaPolicy.from_options(None, LOOPBACK)


def encoded(size: tuple[int, int], color: tuple[int, ...], fmt: str = "PNG", mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, fmt)
    return buffer.getvalue()


def data_url(body: bytes, subtype: str = "png") -> str:
    return f"data:image/{subtype};base64,{base64.b64encode(body).decode()}"


def png_data_url(color: tuple[int, int, int] = RED, size: tuple[int, int] = (4, 4)) -> str:
    """A real (decodable) PNG as a data: URL: what a test sends when any image will do."""
    return data_url(encoded(size, color))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and carries no pixel data at all."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", b"\0" * 16)


CAT_PNG = encoded((3, 2), RED)
DOG_JPEG = encoded((8, 8), BLUE, "JPEG")
GREEN_PNG = encoded((5, 4), GREEN)

Route = Callable[[asyncio.StreamWriter], Awaitable[None]]


class ImageServer:
    """A small HTTP/1.1 server (one request per connection) with the routes the tests need, on
    ``host`` (a loopback address). ``routes`` adds or replaces exact paths; ``hosts`` records each
    request's Host header, ``hits`` each path."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.hits: Counter[str] = Counter()
        self.hosts: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.permits = asyncio.Semaphore(0)  # gated routes answer one per permit
        self.endless_dropped = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.routes: dict[str, Route] = {
            "/cat.png": lambda w: respond(w, 200, CAT_PNG),
            "/dog.jpg": lambda w: respond(w, 200, DOG_JPEG, "image/jpeg"),
            "/missing": lambda w: respond(w, 404, b"not found", "text/plain"),
            "/secret": lambda w: respond(w, 401, b"who are you?", "text/plain"),
            "/broken": lambda w: respond(w, 500, b"oops", "text/plain"),
            "/garbage": lambda w: respond(w, 200, b"GIF89a? no: just bytes" * 50),
            "/bomb.png": lambda w: respond(w, 200, png_header(100_000, 100_000)),
            "/big-header.png": lambda w: respond(w, 200, png_header(5000, 5000)),
            "/to-file": lambda w: respond(w, 302, b"", headers={"location": "file:///etc/passwd"}),
            "/slow": self._trickle,
            "/endless": self._endless,
            "/declared-huge": self._declared_huge,
            "/hang": self._hang,
        }

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def url(self, path: str, host: str | None = None) -> str:
        """``path`` on this server, its host spelled ``host`` (default: the address it is bound to)."""
        shown = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"http://{shown}:{self.port}{path}"

    def serve(self, path: str, body: bytes, status: int = 200, **headers: str) -> None:
        self.routes[path] = lambda w: respond(w, status, body, headers=headers)

    def redirect(self, path: str, location: str) -> None:
        self.routes[path] = lambda w: respond(w, 302, b"", headers={"location": location})

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self.permits.release()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode().partition("?")[0]
            self.hosts += [
                line[5:].strip().decode() for line in head.split(b"\r\n") if line.lower().startswith(b"host:")
            ]
            self.hits[path] += 1
            await self._route(path, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _route(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path in self.routes:
            await self.routes[path](writer)
        elif path.startswith("/hop/"):  # /hop/N redirects N times, then serves the cat
            left = int(path.removeprefix("/hop/"))
            target = f"/hop/{left - 1}" if left > 1 else "/cat.png"
            await respond(writer, 302, b"", headers={"location": target})
        elif path.startswith("/flaky/"):  # fails the first time only
            first = self.hits[path] == 1
            await (respond(writer, 500, b"oops", "text/plain") if first else respond(writer, 200, CAT_PNG))
        elif path.startswith(("/gated/", "/gated-500/")):
            await self._gated(path, writer)
        else:
            await respond(writer, 404, b"", "text/plain")

    async def _gated(self, path: str, writer: asyncio.StreamWriter) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.permits.acquire()
        finally:
            self.in_flight -= 1
        if path.startswith("/gated-500/"):
            await respond(writer, 500, b"oops", "text/plain")
        else:
            await respond(writer, 200, CAT_PNG)

    async def _trickle(self, writer: asyncio.StreamWriter) -> None:
        """Headers, then one byte at a time, never finishing (each read is quick; the whole is not)."""
        writer.write(head(200, {"content-type": "image/png", "content-length": "1000000"}))
        while True:
            writer.write(b"\0")
            await writer.drain()
            await asyncio.sleep(0.05)  # pacing, not synchronisation

    async def _endless(self, writer: asyncio.StreamWriter) -> None:
        """A body with no length that never ends, until the client hangs up."""
        writer.write(head(200, {"content-type": "image/png"}))
        try:
            while True:
                writer.write(CHUNK)
                await writer.drain()
        except ConnectionError:
            self.endless_dropped.set()

    async def _declared_huge(self, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, {"content-type": "image/png", "content-length": str(10**9)}))
        await writer.drain()
        await asyncio.Event().wait()  # never sends the body

    async def _hang(self, writer: asyncio.StreamWriter) -> None:
        """Reads the request and never answers."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.Event().wait()
        finally:
            self.in_flight -= 1


def head(status: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "image/png",
    headers: Mapping[str, str] | None = None,
) -> None:
    fields = {"content-type": content_type, "content-length": str(len(body)), **(headers or {})}
    writer.write(head(status, fields) + body)
    await writer.drain()


class ServedImages(str):
    """The base URL of a threaded image server, with the paths it was asked for."""

    hits: Counter[str]


@contextlib.contextmanager
def served_images(files: Mapping[str, bytes], host: str = "127.0.0.1") -> Iterator[ServedImages]:
    """``files`` (path -> body) served on ``host`` from a thread while the block runs; its base URL."""
    hits: Counter[str] = Counter()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits[self.path] += 1
            body = files.get(self.path)
            self.send_response(404 if body is None else 200)
            self.send_header("content-length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = ServedImages(f"http://{host}:{server.server_address[1]}")
        base.hits = hits
        yield base
    finally:
        server.shutdown()
        server.server_close()
