"""One attack of ``benchmarks.hostile_media``, run in a process of its own against a code tree.

``python -c "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')" THIS_FILE ATTACK``
with the tree to measure on ``PYTHONPATH`` (this tree, or a checkout of an older one): only the
standard library and ``dynamo_prep`` are imported, and the fetcher is used the way both the old
and the new code take it. Prints one JSON line: what the attack got, and the figures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import resource
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from dynamo_prep.engines import images as fetching
from dynamo_prep.protocol.preprocessed import ImageRef

try:  # the new code: a worker fetches from public addresses only unless allowed
    from dynamo_prep.engines.media_policy import MediaPolicy

    LOOPBACK: dict[str, Any] = {"policy": MediaPolicy.from_options(None, ["127.0.0.0/8", "::1/128"])}
    NEW = True
except ImportError:  # the old code fetched from anywhere
    LOOPBACK, NEW = {}, False

Handler = Callable[[str, dict[str, str], asyncio.StreamWriter], Awaitable[None]]


def png(width: int, height: int, pixel: bytes) -> bytes:
    """A PNG of one colour (RGB or RGBA by ``pixel``'s length), compressed a row at a time."""
    packer = zlib.compressobj(6)
    row = b"\0" + pixel * width
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    kind = {3: 2, 4: 6}[len(pixel)]
    header = struct.pack(">IIBBBBB", width, height, 8, kind, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


class Server:
    """An HTTP/1.1 server on a loopback address: ``handler(path, headers, writer)`` answers."""

    def __init__(self, host: str, handler: Handler) -> None:
        self.host, self.handler = host, handler
        self.hits: Counter[str] = Counter()
        self.auth: list[str] = []
        self.in_flight = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    def url(self, path: str, host: str | None = None) -> str:
        shown = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"http://{shown}:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            path = head.split(" ", 2)[1]
            headers = dict(
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(":") for line in head.split("\r\n")[1:] if line)
            )
            self.hits[path] += 1
            if "authorization" in headers:
                self.auth.append(headers["authorization"])
            self.in_flight += 1
            try:
                await self.handler(path, headers, writer)
            finally:
                self.in_flight -= 1
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def respond(writer: asyncio.StreamWriter, status: int, body: bytes = b"", **headers: str) -> None:
    fields = {"connection": "close", "content-length": str(len(body)), **headers}
    head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    writer.write(f"HTTP/1.1 {status} X\r\n{head}\r\n".encode() + body)
    await writer.drain()


def ref(url: str) -> ImageRef:
    return ImageRef(url=url, uuid=hashlib.sha256(url.encode()).hexdigest()[:32])  # as the frontend


def picture(image: Any) -> Any:
    return getattr(image, "image", image)  # the new fetcher returns the image with its identity


async def attempt(fetcher: Any, urls: list[str]) -> tuple[str, list[Any]]:
    try:
        return "served", [picture(image) for image in await fetcher.fetch([ref(url) for url in urls])]
    except fetching.ImageError as exc:
        return str(exc), []


CAT = png(8, 8, b"\xff\x00\x00")


async def ssrf() -> dict[str, Any]:
    """Row 3: the issue's spellings of this host, credentials, a redirect into another host; and
    what a scanner reads back."""

    async def serve(path: str, headers: dict[str, str], writer: asyncio.StreamWriter) -> None:
        if path == "/cat.png":
            await respond(writer, 200, CAT)
        elif path == "/secret":
            await respond(writer, 401)
        elif path == "/broken":
            await respond(writer, 500)
        elif path.startswith("/to/"):
            await respond(writer, 302, location=path.removeprefix("/to/"))
        else:
            await asyncio.Event().wait()  # never answers

    async with (
        Server("127.0.0.1", serve) as v4,
        Server("::1", serve) as v6,
        Server("127.0.0.2", serve) as other,
    ):
        fetcher = fetching.ImageFetcher(fetching.ImageLimits(fetch_timeout_s=2.0))
        urls = {
            host: v4.url("/cat.png", host)
            for host in ("127.0.0.1", "localhost", "0.0.0.0", "2130706433", "0x7f000001", "127.1",
                         "[::ffff:127.0.0.1]")
        }  # fmt: skip
        urls["[::1]"] = v6.url("/cat.png")
        urls["user:pw@127.0.0.1"] = v4.url("/cat.png", "user:pw@127.0.0.1")
        urls["302 into 127.0.0.1"] = other.url(f"/to/{v4.url('/cat.png')}")
        outcomes = {name: (await attempt(fetcher, [url]))[0] for name, url in urls.items()}
        scans = {
            "401": v4.url("/secret"), "500": v4.url("/broken"), "closed port": "http://127.0.0.1:9/x.png",
            "no answer": v4.url("/hang"),
        }  # fmt: skip
        # the scanner's view where the operator allowed the network (the new code; the old fetched anyway)
        scanner = fetching.ImageFetcher(fetching.ImageLimits(fetch_timeout_s=2.0), **LOOPBACK)
        messages = {name: (await attempt(scanner, [url]))[0] for name, url in scans.items()}
        await fetcher.aclose()
        await scanner.aclose()
    fetched = [name for name, outcome in outcomes.items() if outcome == "served"]
    return {
        "fetched": len(fetched),
        "of": len(outcomes),
        "fetched_spellings": fetched,
        "basic_auth_sent": len(v4.auth),
        "outcomes": outcomes,
        "scanner_reads": messages,
        "distinct_scanner_messages": len(set(messages.values())),
    }


async def hung() -> dict[str, Any]:
    """Row 5: two requests of 64 image URLs that never answer, then a victim with one small image
    from another host name; how long the victim waits (the fetcher's default limits)."""

    async def serve(path: str, headers: dict[str, str], writer: asyncio.StreamWriter) -> None:
        if path == "/small.png":
            await respond(writer, 200, CAT)
        else:
            await asyncio.Event().wait()

    async with Server("127.0.0.1", serve) as server:
        fetcher = fetching.ImageFetcher(**LOOPBACK)
        started = time.monotonic()
        attackers = [
            asyncio.ensure_future(attempt(fetcher, [server.url(f"/hang/{r}/{i}") for i in range(64)]))
            for r in range(2)
        ]
        while server.in_flight < 4:  # the attackers' downloads are in
            await asyncio.sleep(0.01)
        victim_started = time.monotonic()
        outcome, _ = await attempt(fetcher, [server.url("/small.png", "localhost")])
        victim_s = time.monotonic() - victim_started
        attackers_waiting = sum(not task.done() for task in attackers)
        results = await asyncio.gather(*attackers)
        attackers_s = time.monotonic() - started
        await fetcher.aclose()
    return {
        "victim": outcome,
        "victim_wait_s": round(victim_s, 3),
        "attackers_still_waiting_when_victim_done": attackers_waiting,
        "attackers_end_s": round(attackers_s, 1),
        "attackers": [message for message, _ in results],
    }


async def pixels(count: int, pixel: bytes) -> dict[str, Any]:
    """Row 7: ``count`` PNGs of 7071x7071 (under the 50 M-pixel limit of one image) in one request:
    the process's peak RSS growth and the event loop's longest lag while it is fetched."""
    body = png(7071, 7071, pixel)

    async def serve(path: str, headers: dict[str, str], writer: asyncio.StreamWriter) -> None:
        await respond(writer, 200, body)

    lag = 0.0

    async def ticker() -> None:
        nonlocal lag
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lag = max(lag, time.monotonic() - before - 0.01)

    async with Server("127.0.0.1", serve) as server:
        fetcher = fetching.ImageFetcher(**LOOPBACK)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ticking = asyncio.ensure_future(ticker())
        started = time.monotonic()
        outcome, decoded = await attempt(fetcher, [server.url(f"/{n}.png") for n in range(count)])
        took = time.monotonic() - started
        # a refused request's decodes already running go on in their threads: count them too
        await asyncio.get_running_loop().shutdown_default_executor()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ticking.cancel()
        await fetcher.aclose()
    return {
        "images": count,
        "mode": "RGBA" if len(pixel) == 4 else "RGB",
        "encoded_kb": len(body) // 1024,
        "outcome": outcome if outcome != "served" else f"served {len(decoded)}",
        "rss_growth_mb": round((peak - base) / 1024),
        "loop_lag_max_ms": round(lag * 1000, 1),
        "seconds": round(took, 2),
    }


async def changed() -> dict[str, Any]:
    """Row 13: the image at a URL changes between two requests; which one the second one gets."""
    colours = [png(8, 8, b"\xff\x00\x00"), png(8, 8, b"\x00\x00\xff")]

    async def serve(path: str, headers: dict[str, str], writer: asyncio.StreamWriter) -> None:
        await respond(writer, 200, colours[0] if server.hits[path] == 1 else colours[1])

    async with Server("127.0.0.1", serve) as server:
        fetcher = fetching.ImageFetcher(**LOOPBACK)
        got = []
        for _ in range(2):
            images = await fetcher.fetch([ref(server.url("/photo.png"))])
            got.append(images[0])
        await fetcher.aclose()
    first, second = (picture(image).getpixel((0, 0)) for image in got)
    uuids = [getattr(image, "uuid", ref(server.url("/photo.png")).uuid) for image in got]
    return {
        "first": "red" if first == (255, 0, 0) else str(first),
        "second": "blue (the new image)" if second == (0, 0, 255) else "red (the old image)",
        "engine_uuids_differ": uuids[0] != uuids[1],
        "downloads": server.hits["/photo.png"],
    }


ATTACKS: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
    "ssrf": ssrf,
    "hung": hung,
    "pixels_4": lambda: pixels(4, b"\x10\x20\x30"),
    "pixels_8": lambda: pixels(8, b"\x10\x20\x30"),
    "pixels_rgba_1": lambda: pixels(1, b"\x10\x20\x30\x80"),
    "changed": changed,
}


if __name__ == "__main__":
    name = sys.argv[-1]
    result = asyncio.run(ATTACKS[name]())
    print(json.dumps({"attack": name, "code": "new" if NEW else "old", **result}), flush=True)
