"""Request images for a real engine: fetched by the worker, checked, decoded to RGB, cached.

Only http(s) URLs and base64 ``data:image/...`` URLs are accepted, and engines get decoded images
only, never a string they would read as a file path or as base64 (SGLang does). ``ImageLimits``
bounds bytes, pixels (read from the header, before decoding), time, redirects, concurrency and the
cache. Only worker processes that run a real engine import this module (it loads Pillow and httpx).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Final, Literal
from urllib.parse import urlsplit

import httpx
import structlog
from PIL import Image, UnidentifiedImageError

from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.logging import DETAIL_CHARS
from dynamo_prep.protocol.preprocessed import ImageRef

__all__ = ["ImageError", "ImageFailure", "ImageFetcher", "ImageLimits", "clip_url"]

log = structlog.get_logger("dynamo_prep.engines")

MiB: Final = 1024 * 1024
URL_CHARS: Final = 100  # the longest URL a message or a log line shows
# The frontend's grammar (formatter/parts.py): a base64 data:image URL, optional parameters.
_DATA_HEADER: Final = re.compile(r"data:image/[A-Za-z0-9.+-]+(?:;[A-Za-z0-9=._+-]+)*;base64")
_UNSAFE_URL_CHARS: Final = re.compile(r"[\x00-\x20\x7f]")
_SPACE: Final = re.compile(r"\s")
_HEADERS: Final = {"accept": "image/*, */*;q=0.5", "accept-encoding": "identity", "user-agent": "dynamo-prep"}
_WHITE: Final = (255, 255, 255)

ImageFailure = Literal[
    "too_many_images",
    "unsupported_url",
    "bad_url",
    "bad_data_url",
    "http_status",
    "too_many_redirects",
    "bad_redirect",
    "timeout",
    "fetch_error",
    "too_large",
    "too_many_pixels",
    "not_an_image",
    "decode_failed",
]


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one worker process spends on request images; every default lives here."""

    max_bytes: int = 20 * MiB  # one encoded image (OpenAI's own per-image limit)
    # width * height, read from the header before decoding; below Pillow's own bomb warning (89 M), and
    # Pillow refuses more than twice that whatever this says
    max_pixels: int = 50_000_000
    fetch_timeout_s: float = 10.0  # one image's whole download, redirects included
    max_redirects: int = 3
    max_concurrent: int = 8  # downloads in flight per process
    cache_items: int = 256  # decoded images kept (0: no cache)
    cache_bytes: int = 512 * MiB  # their RGB pixel bytes (a 50 M-pixel image is 150 MB)
    max_images: int = 64  # per request
    formats: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # Pillow's plugin ids

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_concurrent", "max_images"):
            _require_at_least(name, getattr(self, name), 1)
        for name in ("max_redirects", "cache_items", "cache_bytes"):
            _require_at_least(name, getattr(self, name), 0)
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"ImageLimits.fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        Image.init()  # registers every plugin Pillow has, so the ids can be checked
        if not self.formats or set(self.formats) - set(Image.OPEN):
            raise ValueError(f"ImageLimits.formats must be Pillow image ids, got {self.formats!r}")


def _require_at_least(name: str, value: int, floor: int) -> None:
    if value < floor:
        raise ValueError(f"ImageLimits.{name} must be >= {floor}, got {value}")


class ImageError(EngineContractError):
    """A request image that cannot reach the engine; the worker answers with a 400 and the message.

    ``index`` is the image's 0-based position in the request (the message counts from 1), None for
    a fault of the whole request (too many images); ``reason`` is a stable label for logs.
    """

    def __init__(self, message: str, *, reason: ImageFailure, index: int | None = None) -> None:
        super().__init__(message)
        self.reason: ImageFailure = reason
        self.index = index


class _FaultError(Exception):
    """Why one image failed, before it is named by a request position (fetches are shared)."""

    def __init__(self, reason: ImageFailure, detail: str) -> None:
        super().__init__(detail)
        self.reason: ImageFailure = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class _Http:
    url: str


@dataclass(frozen=True, slots=True)
class _Data:
    payload: str


_Source = _Http | _Data


@dataclass(slots=True)
class _Flight:
    """One fetch in progress and how many requests wait on it."""

    task: asyncio.Task[Image.Image]
    waiters: int = 0


DEFAULT_LIMITS: Final = ImageLimits()


class ImageFetcher:
    """Fetches and decodes request images, one per process; call ``aclose`` when done.

    Images are cached and shared between requests: treat them as read-only.
    """

    def __init__(
        self, limits: ImageLimits = DEFAULT_LIMITS, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.limits = limits
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=limits.fetch_timeout_s,
            follow_redirects=False,  # followed by hand: counted, bodies unread, schemes checked
            headers=_HEADERS,
            # no cookie is ever kept: one request's cookies must not reach another's fetch
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            limits=httpx.Limits(max_connections=limits.max_concurrent),
        )
        self._slots = asyncio.Semaphore(limits.max_concurrent)
        self._cache = _ImageCache(limits.cache_items, limits.cache_bytes)
        self._flights: dict[str, _Flight] = {}

    async def fetch(self, images: Sequence[ImageRef]) -> list[Image.Image]:
        """The request's images as RGB, in order; any refusal is an ``ImageError`` naming the image."""
        self._check_count(len(images))
        sources = [self._parse(index, images) for index in range(len(images))]
        tasks = [asyncio.ensure_future(self._one(index, images, s)) for index, s in enumerate(sources)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # after a failure, the rest are not needed (shared fetches go on)
                task.cancel()

    async def aclose(self) -> None:
        """Stop every fetch in progress, drop the cache and close the HTTP client."""
        flights = [flight.task for flight in self._flights.values()]
        self._flights.clear()
        for task in flights:
            task.cancel()
        await asyncio.gather(*flights, return_exceptions=True)
        self._cache.clear()
        await self._client.aclose()

    def _check_count(self, count: int) -> None:
        if count > self.limits.max_images:
            log.warning("images_refused", reason="too_many_images", count=count, limit=self.limits.max_images)
            raise ImageError(
                f"too many images: {count} in one request, the limit is {self.limits.max_images}",
                reason="too_many_images",
            )

    def _parse(self, index: int, images: Sequence[ImageRef]) -> _Source:
        try:
            return _source(images[index].url)
        except _FaultError as fault:
            raise _refusal(index, images, fault) from None

    async def _one(self, index: int, images: Sequence[ImageRef], source: _Source) -> Image.Image:
        ref = images[index]
        key = ref.uuid or _url_key(ref.url)
        image = self._cache.get(key)
        if image is not None:
            return image
        try:
            return await self._shared(key, source)
        except _FaultError as fault:
            raise _refusal(index, images, fault) from None

    async def _shared(self, key: str, source: _Source) -> Image.Image:
        """Wait on the one fetch of ``key``, starting it if none runs; the last waiter to leave stops it."""
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = _Flight(asyncio.ensure_future(self._load(key, source)))
            flight.task.add_done_callback(lambda task: self._landed(key, task))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)  # a waiter's cancellation is its own
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                self._abandon(key, flight)

    def _landed(self, key: str, task: asyncio.Task[Image.Image]) -> None:
        flight = self._flights.get(key)
        if flight is not None and flight.task is task:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it, or none was left to

    def _abandon(self, key: str, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]  # a later request starts afresh instead of joining a cancelled fetch
        flight.task.cancel()

    async def _load(self, key: str, source: _Source) -> Image.Image:
        started = time.monotonic()
        if isinstance(source, _Http):
            data = await self._download(source.url)
            image = await asyncio.to_thread(_decode_image, data, self.limits)
        else:
            image = await asyncio.to_thread(_decode_data, source.payload, self.limits)
        self._cache.put(key, image)
        log.debug(
            "image_loaded",
            key=key,
            source="http" if isinstance(source, _Http) else "data",
            width=image.width,
            height=image.height,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
        )
        return image

    async def _download(self, url: str) -> bytes:
        timeout_s = self.limits.fetch_timeout_s
        async with self._slots:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._follow(url)
            except (TimeoutError, httpx.TimeoutException):
                raise _FaultError(
                    "timeout", f"fetch failed: no complete answer within {timeout_s:g} s"
                ) from None
            except httpx.HTTPError as exc:
                raise _FaultError("fetch_error", f"fetch failed: {_describe(exc)}") from None

    async def _follow(self, url: str) -> bytes:
        """The body at ``url`` after at most ``max_redirects`` redirects (whose bodies are never read)."""
        request = self._client.build_request("GET", url)
        for _ in range(self.limits.max_redirects + 1):
            response = await self._client.send(request, stream=True)
            try:
                if response.next_request is None:
                    return await _body(response, self.limits.max_bytes)
                request = _redirect(response.next_request)
            finally:
                await response.aclose()
        raise _FaultError(
            "too_many_redirects", f"fetch failed: more than {self.limits.max_redirects} redirects"
        )


class _ImageCache:
    """Decoded images by key, least recently used first out, bounded by count and by pixel bytes."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, tuple[Image.Image, int]] = OrderedDict()

    def get(self, key: str) -> Image.Image | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, image: Image.Image) -> None:
        size = image.width * image.height * len(image.getbands())
        if self._max_items == 0 or size > self._max_bytes:
            return
        self._drop(key)
        self._entries[key] = (image, size)
        self._bytes += size
        while len(self._entries) > self._max_items or self._bytes > self._max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1]


def clip_url(url: str) -> str:
    """A URL as messages and logs show it: a data: URL by its header, an http(s) URL without
    credentials or query, anything else by its start; printable, at most ``URL_CHARS`` characters."""
    if url.startswith("data:"):
        head, comma, _ = url[:URL_CHARS].partition(",")
        shown = f"{head},…" if comma else f"{head}…"
    elif url.startswith(("http://", "https://")):
        shown = _without_secrets(url)
    else:
        shown = url[: URL_CHARS + 1]
    shown = "".join(char if char.isprintable() else "?" for char in shown[: URL_CHARS + 1])
    return shown if len(shown) <= URL_CHARS else shown[: URL_CHARS - 1] + "…"


def _without_secrets(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url[: URL_CHARS + 1]
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}{'?…' if parts.query else ''}"


def _refusal(index: int, images: Sequence[ImageRef], fault: _FaultError) -> ImageError:
    url = clip_url(images[index].url)
    log.warning(
        "image_fetch_failed",
        reason=fault.reason,
        index=index,
        count=len(images),
        url=url,
        detail=fault.detail[:DETAIL_CHARS],
    )
    message = f"image {index + 1} of {len(images)} ({url}): {fault.detail}"
    return ImageError(message, reason=fault.reason, index=index)


def _source(url: str) -> _Source:
    """What an accepted URL reads; any other string fails here and never reaches an engine."""
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not _DATA_HEADER.fullmatch(header):
            raise _FaultError(
                "bad_data_url", "a data: image URL must be data:image/<type>;base64,<base64 data>"
            )
        return _Data(payload)
    if url.startswith(("http://", "https://")):
        _check_http_url(url)
        return _Http(url)
    raise _FaultError(
        "unsupported_url", "not an accepted image URL: only http(s) URLs and base64 data:image URLs are"
    )


def _check_http_url(url: str) -> None:
    try:
        valid = (
            not _UNSAFE_URL_CHARS.search(url) and bool(urlsplit(url).hostname) and bool(httpx.URL(url).host)
        )
    except (ValueError, httpx.InvalidURL):
        valid = False
    if not valid:
        raise _FaultError("bad_url", "not a valid http(s) URL (a host, no spaces or control characters)")


def _url_key(url: str) -> str:
    """The cache key of an image the frontend sent without a uuid: a hash of its URL (bounded size)."""
    return "url:" + hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()


def _redirect(request: httpx.Request) -> httpx.Request:
    if request.url.scheme not in ("http", "https"):
        raise _FaultError("bad_redirect", f"fetch failed: redirected to a {request.url.scheme}: URL")
    return request


async def _body(response: httpx.Response, max_bytes: int) -> bytes:
    """A 2xx response's body, read no further than ``max_bytes``."""
    if not response.is_success:
        raise _FaultError("http_status", f"fetch failed: HTTP {response.status_code}")
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    try:
        body = response.content  # a transport that answered from memory (httpx.MockTransport)
    except httpx.ResponseNotRead:
        body = await _read_raw(response, max_bytes)
    if len(body) > max_bytes:
        raise _too_large(max_bytes)
    return body


async def _read_raw(response: httpx.Response, max_bytes: int) -> bytes:
    """The bytes as sent (identity was asked for: no decompression can inflate them past the cap)."""
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def _decode_data(payload: str, limits: ImageLimits) -> Image.Image:
    """A data: URL's image (runs in a worker thread: base64 and pixels are both CPU work)."""
    if _SPACE.search(payload):  # the frontend allows line breaks in base64
        payload = "".join(payload.split())
    if len(payload) * 3 // 4 - payload[-2:].count("=") > limits.max_bytes:
        raise _too_large(limits.max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except ValueError:
        raise _FaultError("bad_data_url", "the data: URL's payload is not valid base64") from None
    return _decode_image(data, limits)


def _decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """Decoded RGB pixels, the pixel count checked from the header first (runs in a worker thread)."""
    try:
        with Image.open(io.BytesIO(data), formats=limits.formats) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise _FaultError(
                    "too_many_pixels",
                    f"the image is {width}x{height} pixels, more than the {limits.max_pixels}-pixel limit",
                )
            return _rgb(image)
    except Image.DecompressionBombError:
        raise _FaultError(
            "too_many_pixels", f"the image has more pixels than the {limits.max_pixels}-pixel limit"
        ) from None
    except UnidentifiedImageError:
        accepted = ", ".join(limits.formats)
        raise _FaultError("not_an_image", f"not an image in an accepted format ({accepted})") from None
    except _FaultError:
        raise
    except Exception as exc:  # Pillow's decoders raise many types on corrupt data
        raise _FaultError("decode_failed", f"the image could not be decoded: {_describe(exc)}") from None


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency composited onto white as vLLM's own image loader does."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, _WHITE)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB")


def _too_large(max_bytes: int) -> _FaultError:
    return _FaultError("too_large", f"the image is larger than the {max_bytes}-byte limit")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:DETAIL_CHARS] if text else type(exc).__name__
