"""The worker's image fetcher against a real HTTP server on loopback: what it accepts, bounds, shares.

The server runs in the test's own event loop; requests are counted on the server side, and blocking
routes wait for permits the test hands out, so every wait is on a condition, never on time.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from PIL import Image
from support.logs import Logs, find, until

from dynamo_prep.engines.images import ImageError, ImageFetcher, ImageLimits, clip_url
from dynamo_prep.protocol.preprocessed import ImageRef

RED, GREEN, BLUE = (255, 0, 0), (0, 160, 0), (0, 0, 255)
CHUNK = b"\0" * 65536
DEADLINE_S = 10.0
MakeFetcher = Callable[..., ImageFetcher]


def encoded(size: tuple[int, int], color: tuple[int, int, int], fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and carries no pixel data at all."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", b"\0" * 16)


def data_url(body: bytes, subtype: str = "png") -> str:
    return f"data:image/{subtype};base64,{base64.b64encode(body).decode()}"


CAT_PNG = encoded((3, 2), RED, "PNG")
DOG_JPEG = encoded((8, 8), BLUE, "JPEG")
GREEN_PNG = encoded((5, 4), GREEN, "PNG")


class ImageServer:
    """A small HTTP/1.1 server (one request per connection) with the routes the tests need."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.permits = asyncio.Semaphore(0)  # gated routes answer one per permit
        self.endless_dropped = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exact: dict[str, Callable[[asyncio.StreamWriter], Awaitable[None]]] = {
            "/cat.png": lambda w: respond(w, 200, CAT_PNG),
            "/dog.jpg": lambda w: respond(w, 200, DOG_JPEG, "image/jpeg"),
            "/missing": lambda w: respond(w, 404, b"not found", "text/plain"),
            "/garbage": lambda w: respond(w, 200, b"GIF89a? no: just bytes" * 50),
            "/bomb.png": lambda w: respond(w, 200, png_header(100_000, 100_000)),
            "/big-header.png": lambda w: respond(w, 200, png_header(5000, 5000)),
            "/to-file": lambda w: respond(w, 302, b"", headers={"location": "file:///etc/passwd"}),
            "/slow": self._trickle,
            "/endless": self._endless,
            "/declared-huge": self._declared_huge,
        }

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

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
            self.hits[path] += 1
            await self._route(path, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _route(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path in self._exact:
            await self._exact[path](writer)
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


def head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "image/png",
    headers: dict[str, str] | None = None,
) -> None:
    fields = {"content-type": content_type, "content-length": str(len(body)), **(headers or {})}
    writer.write(head(status, fields) + body)
    await writer.drain()


@pytest.fixture
async def server() -> AsyncIterator[ImageServer]:
    image_server = ImageServer()
    await image_server.start()
    yield image_server
    await image_server.close()


@pytest.fixture
async def make_fetcher() -> AsyncIterator[MakeFetcher]:
    fetchers: list[ImageFetcher] = []

    def make(**limits: Any) -> ImageFetcher:
        fetchers.append(ImageFetcher(ImageLimits(**limits)))
        return fetchers[-1]

    yield make
    for fetcher in fetchers:
        await fetcher.aclose()


def requests_reach(server: ImageServer, count: int) -> Callable[[], bool]:
    return lambda: sum(server.hits.values()) >= count


def ref(url: str, uuid: str = "") -> ImageRef:
    return ImageRef(url=url, uuid=uuid)


async def refusal(fetcher: ImageFetcher, images: list[ImageRef]) -> ImageError:
    with pytest.raises(ImageError) as caught:
        await asyncio.wait_for(fetcher.fetch(images), DEADLINE_S)
    return caught.value


# --- what is accepted, in order ---


async def test_order_is_kept_across_http_and_data_urls(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    images = await fetcher.fetch(
        [
            ref(server.url("/cat.png"), "cat"),
            ref(data_url(GREEN_PNG), "green"),
            ref(server.url("/dog.jpg"), "dog"),
            ref(data_url(encoded((2, 7), BLUE, "JPEG"), "jpeg"), "small-jpeg"),
        ]
    )
    assert [image.size for image in images] == [(3, 2), (5, 4), (8, 8), (2, 7)]
    assert all(image.mode == "RGB" for image in images)
    assert images[0].getpixel((0, 0)) == RED
    assert images[1].getpixel((0, 0)) == GREEN
    assert server.hits == Counter({"/cat.png": 1, "/dog.jpg": 1})


async def test_no_images_is_no_work(make_fetcher: MakeFetcher) -> None:
    assert await make_fetcher().fetch([]) == []


async def test_transparency_is_composited_onto_white(make_fetcher: MakeFetcher) -> None:
    solid = io.BytesIO()
    Image.new("RGBA", (2, 2), (255, 0, 0, 255)).save(solid, "PNG")
    see_through = io.BytesIO()
    Image.new("RGBA", (2, 2), (255, 0, 0, 0)).save(see_through, "PNG")
    images = [ref(data_url(solid.getvalue())), ref(data_url(see_through.getvalue()))]
    opaque, transparent = await make_fetcher().fetch(images)
    assert opaque.mode == transparent.mode == "RGB"
    assert opaque.getpixel((0, 0)) == RED
    assert transparent.getpixel((0, 0)) == (255, 255, 255)


async def test_redirects_up_to_the_limit_are_followed(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    (image,) = await make_fetcher(max_redirects=3).fetch([ref(server.url("/hop/3"))])
    assert image.size == (3, 2)
    assert server.hits["/cat.png"] == 1


async def test_a_transport_stands_in_for_the_network() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, content=CAT_PNG)

    fetcher = ImageFetcher(transport=httpx.MockTransport(answer))
    try:
        (image,) = await fetcher.fetch([ref("https://images.example/cat.png")])
    finally:
        await fetcher.aclose()
    assert image.size == (3, 2)
    assert seen == ["https://images.example/cat.png"]


# --- what is refused, and how it is named ---


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "unsupported_url"),
        ("/etc/passwd", "unsupported_url"),
        ("cat.png", "unsupported_url"),
        (base64.b64encode(CAT_PNG).decode(), "unsupported_url"),
        ("data:text/plain;base64,aGVsbG8=", "bad_data_url"),
        ("data:image/png,notbase64", "bad_data_url"),
        ("ftp://x/y.png", "unsupported_url"),
        ("HTTP://example.com/a.png", "unsupported_url"),
        ("http://", "bad_url"),
        ("http://exa mple.com/a.png", "bad_url"),
    ],
)
async def test_other_forms_are_refused_before_any_fetch(
    url: str, reason: str, server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(
        make_fetcher(), [ref(server.url("/cat.png")), ref(url), ref(server.url("/dog.jpg"))]
    )
    assert (error.index, error.reason) == (1, reason)
    assert str(error).startswith(f"image 2 of 3 ({clip_url(url)}): ")
    assert server.hits == Counter()  # every image is checked before any is fetched


async def test_a_data_url_that_is_not_base64_is_refused(make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(), [ref(data_url(GREEN_PNG)), ref("data:image/png;base64,***")])
    assert str(error) == "image 2 of 2 (data:image/png;base64,…): the data: URL's payload is not valid base64"
    assert (error.index, error.reason) == (1, "bad_data_url")


async def test_http_error_status_names_the_image(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(), [ref(server.url("/cat.png")), ref(server.url("/missing"))])
    assert str(error) == f"image 2 of 2 ({server.url('/missing')}): fetch failed: HTTP 404"
    assert (error.index, error.reason) == (1, "http_status")


async def test_messages_never_carry_query_strings_or_credentials(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    url = f"http://user:hunter2@127.0.0.1:{server.port}/missing?signature=s3cr3t"
    error = await refusal(make_fetcher(), [ref(url)])
    assert str(error) == f"image 1 of 1 (http://127.0.0.1:{server.port}/missing?…): fetch failed: HTTP 404"


async def test_data_urls_are_named_by_their_header_only(make_fetcher: MakeFetcher) -> None:
    payload = base64.b64encode(b"not an image at all" * 1000).decode()
    error = await refusal(make_fetcher(), [ref(f"data:image/png;base64,{payload}")])
    assert str(error).startswith("image 1 of 1 (data:image/png;base64,…): not an image")
    assert payload[:20] not in str(error)
    assert error.reason == "not_an_image"


async def test_a_redirect_chain_longer_than_the_limit_is_refused(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(make_fetcher(max_redirects=3), [ref(server.url("/hop/4"))])
    assert error.reason == "too_many_redirects"
    assert "more than 3 redirects" in str(error)
    assert sum(server.hits.values()) == 4  # the request and three redirects; the fourth is not followed
    assert server.hits["/cat.png"] == 0


async def test_a_redirect_to_another_scheme_is_refused(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(make_fetcher(), [ref(server.url("/to-file"))])
    assert error.reason == "bad_redirect"


async def test_a_fetch_that_never_finishes_times_out(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(fetch_timeout_s=0.5), [ref(server.url("/slow"))])
    assert error.reason == "timeout"
    assert str(error).startswith(f"image 1 of 1 ({server.url('/slow')}): fetch failed: no complete answer")


async def test_an_endless_body_is_cut_at_the_byte_cap(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(max_bytes=256 * 1024), [ref(server.url("/endless"))])
    assert error.reason == "too_large"  # not a timeout: reading stopped at the cap
    await asyncio.wait_for(server.endless_dropped.wait(), DEADLINE_S)  # and the connection was dropped


async def test_a_declared_length_over_the_cap_is_refused_unread(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(make_fetcher(max_bytes=1024 * 1024), [ref(server.url("/declared-huge"))])
    assert error.reason == "too_large"  # the body never comes: only the header could say so


async def test_a_data_url_over_the_cap_is_refused(make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(max_bytes=100), [ref(data_url(encoded((64, 64), RED, "BMP")))])
    assert error.reason == "too_large"


async def test_a_decompression_bomb_header_is_refused(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(), [ref(server.url("/bomb.png"))])
    assert error.reason == "too_many_pixels"


async def test_the_pixel_cap_is_checked_before_decoding(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    """5000x5000 is no bomb to Pillow, and its pixel data is missing: only the header check refuses it."""
    error = await refusal(make_fetcher(max_pixels=1_000_000), [ref(server.url("/big-header.png"))])
    assert error.reason == "too_many_pixels"
    assert "5000x5000" in str(error)


async def test_bytes_that_are_no_image_are_refused(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(), [ref(server.url("/garbage"))])
    assert error.reason == "not_an_image"


async def test_too_many_images_are_refused_before_any_fetch(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(
        make_fetcher(max_images=2), [ref(server.url(f"/gated/{n}"), str(n)) for n in range(3)]
    )
    assert (error.index, error.reason) == (None, "too_many_images")
    assert str(error) == "too many images: 3 in one request, the limit is 2"
    assert server.hits == Counter()


async def test_failures_are_logged_with_their_reason(
    logs: Logs, server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    await refusal(make_fetcher(), [ref(server.url("/cat.png")), ref(server.url("/missing?token=x"))])
    (line,) = find(logs, "image_fetch_failed")
    assert line["reason"] == "http_status"
    assert (line["index"], line["count"]) == (1, 2)
    assert line["url"] == server.url("/missing?…")
    assert line["log_level"] == "warning"


# --- the cache and shared fetches ---


async def test_a_cached_image_is_not_fetched_again(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    (first,) = await fetcher.fetch([ref(server.url("/cat.png"), "cat")])
    (again,) = await fetcher.fetch([ref(server.url("/cat.png"), "cat")])
    assert again is first
    assert server.hits["/cat.png"] == 1


async def test_without_a_uuid_the_url_is_the_key(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    await fetcher.fetch([ref(server.url("/cat.png"))])
    await fetcher.fetch([ref(server.url("/cat.png"))])
    assert server.hits["/cat.png"] == 1


async def test_the_cache_is_bounded_by_items(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(cache_items=1)
    await fetcher.fetch([ref(server.url("/cat.png"), "cat")])
    await fetcher.fetch([ref(server.url("/dog.jpg"), "dog")])  # evicts the cat
    await fetcher.fetch([ref(server.url("/cat.png"), "cat")])
    assert server.hits["/cat.png"] == 2


async def test_the_cache_is_bounded_by_pixel_bytes(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(cache_bytes=8 * 8 * 3)  # room for the dog (8x8 RGB) alone
    await fetcher.fetch([ref(server.url("/cat.png"), "cat")])
    await fetcher.fetch([ref(server.url("/dog.jpg"), "dog")])  # evicts the cat
    await fetcher.fetch([ref(server.url("/dog.jpg"), "dog")])
    await fetcher.fetch([ref(server.url("/cat.png"), "cat")])
    assert server.hits == Counter({"/cat.png": 2, "/dog.jpg": 1})


async def test_concurrent_requests_for_one_image_share_one_fetch(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    waiters = [asyncio.create_task(fetcher.fetch([ref(server.url("/gated/one"), "one")])) for _ in range(5)]
    # all five joined the fetch within two loop turns; the connection takes many more
    await until(lambda: server.hits["/gated/one"] == 1, "the shared request")
    server.release()
    results = await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE_S)
    assert all(images[0] is results[0][0] for images in results)
    assert server.hits["/gated/one"] == 1


async def test_a_failed_shared_fetch_names_each_waiters_own_image(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    broken = ref(server.url("/gated-500/x"), "x")
    first = asyncio.create_task(fetcher.fetch([ref(data_url(GREEN_PNG)), broken]))
    second = asyncio.create_task(fetcher.fetch([broken]))
    await until(lambda: server.hits["/gated-500/x"] == 1, "the shared request")
    server.release()
    errors = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), DEADLINE_S)
    assert [str(error).split(" (")[0] for error in errors] == ["image 2 of 2", "image 1 of 1"]
    assert all(isinstance(error, ImageError) and error.reason == "http_status" for error in errors)
    assert server.hits["/gated-500/x"] == 1


async def test_a_failed_fetch_is_not_cached(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    error = await refusal(fetcher, [ref(server.url("/flaky/a"), "a")])
    assert "HTTP 500" in str(error)
    (image,) = await fetcher.fetch([ref(server.url("/flaky/a"), "a")])
    assert image.size == (3, 2)
    assert server.hits["/flaky/a"] == 2


async def test_a_cancelled_waiter_leaves_the_shared_fetch_to_the_others(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    leaving = asyncio.create_task(fetcher.fetch([ref(server.url("/gated/two"), "two")]))
    staying = asyncio.create_task(fetcher.fetch([ref(server.url("/gated/two"), "two")]))
    await until(lambda: server.hits["/gated/two"] == 1, "the shared request")
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    server.release()
    (image,) = await asyncio.wait_for(staying, DEADLINE_S)
    assert image.size == (3, 2)
    assert server.hits["/gated/two"] == 1


async def test_when_every_waiter_leaves_the_fetch_stops(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    leaving = asyncio.create_task(fetcher.fetch([ref(server.url("/gated/three"), "three")]))
    await until(lambda: server.hits["/gated/three"] == 1, "the first request")
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    again = asyncio.create_task(fetcher.fetch([ref(server.url("/gated/three"), "three")]))
    await until(lambda: server.hits["/gated/three"] == 2, "a fresh request, not the abandoned one")
    server.release(2)
    (image,) = await asyncio.wait_for(again, DEADLINE_S)
    assert image.size == (3, 2)


async def test_at_most_max_concurrent_fetches_are_in_flight(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(max_concurrent=2)
    count = 5
    request = asyncio.create_task(
        fetcher.fetch([ref(server.url(f"/gated/c{n}"), f"c{n}") for n in range(count)])
    )
    for arrived in range(2, count + 1):  # each released answer lets exactly one more request in
        await until(requests_reach(server, arrived), f"{arrived} requests")
        server.release()
    server.release()
    images = await asyncio.wait_for(request, DEADLINE_S)
    assert len(images) == count
    assert server.max_in_flight == 2


# --- limits ---


@pytest.mark.parametrize(
    "limits",
    [
        {"max_bytes": 0},
        {"max_pixels": 0},
        {"fetch_timeout_s": 0},
        {"max_redirects": -1},
        {"max_concurrent": 0},
        {"cache_items": -1},
        {"max_images": 0},
        {"formats": ()},
        {"formats": ("PNG", "NOPE")},
    ],
)
def test_nonsense_limits_are_refused(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="ImageLimits"):
        ImageLimits(**limits)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://example.com/a.png", "https://example.com/a.png"),
        ("https://u:p@example.com/a.png?X-Amz-Signature=abc#frag", "https://example.com/a.png?…"),
        ("data:image/png;base64," + "A" * 5000, "data:image/png;base64,…"),
        ("data:" + "x" * 5000, "data:" + "x" * 94 + "…"),
        ("/etc/passwd\n", "/etc/passwd?"),
        ("https://example.com/" + "a" * 500, "https://example.com/" + "a" * 79 + "…"),
    ],
)
def test_urls_are_clipped_for_messages_and_logs(url: str, shown: str) -> None:
    assert clip_url(url) == shown
