"""Request images for an engine: fetched by the worker, checked, decoded to RGB, named by their bytes.

Only http(s) URLs and base64 ``data:image/...`` URLs are accepted, and engines get decoded images
only, never a string they would read as a file path or as base64 (SGLang does). Where images may
come from is the ``MediaPolicy``'s to say, checked at every connection (``image_net``); what they
may cost is ``ImageLimits``'s. docs/engines.md ("Images") has the rules and why. Worker processes
import this module (it loads Pillow and httpx); the frontend never does.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import urlsplit

import httpx
import structlog
from PIL import Image, UnidentifiedImageError

from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.engines.image_net import FetchRefusedError, Resolve, checked_client
from dynamo_prep.engines.media_policy import MediaPolicy, normal_host
from dynamo_prep.logging import DETAIL_CHARS
from dynamo_prep.protocol.preprocessed import ImageRef, fetched_image_uuid, image_uuid

__all__ = [
    "DEFAULT_LIMITS",
    "FetchedImage",
    "ImageError",
    "ImageFailure",
    "ImageFetcher",
    "ImageLimits",
    "clip_url",
]

log = structlog.get_logger("dynamo_prep.engines")

MiB: Final = 1024 * 1024
URL_CHARS: Final = 100  # the longest URL a message or a log line shows
# The frontend's grammar (formatter/parts.py): a base64 data:image URL, optional parameters.
_DATA_HEADER: Final = re.compile(r"data:image/[A-Za-z0-9.+-]+(?:;[A-Za-z0-9=._+-]+)*;base64")
_UNSAFE_URL_CHARS: Final = re.compile(r"[\x00-\x20\x7f]")
_SPACE: Final = re.compile(r"\s")
_WHITE: Final = (255, 255, 255)

ImageFailure = Literal[
    "too_many_images",
    "unsupported_url",
    "bad_url",
    "bad_data_url",
    "credentials",
    "domain_not_allowed",
    "address_refused",
    "resolve_failed",
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
    # width * height of one image, read from its header before decoding; below Pillow's own bomb
    # warning (89 M), and Pillow refuses more than twice that whatever this says
    max_pixels: int = 50_000_000
    # every image of one request together (3 bytes a pixel once decoded: 192 MB)
    max_request_pixels: int = 64_000_000
    # pixels being decoded at once in the process (a decode waits, inside its deadline, for room)
    decode_pixels: int = 128_000_000
    # one image: the waits for a download slot and for decode room, the download, redirects included,
    # and the decode; its clock starts when the request lets it start (``max_per_request``)
    fetch_timeout_s: float = 10.0
    request_timeout_s: float = 30.0  # every image of one request
    max_redirects: int = 3
    max_concurrent: int = 16  # downloads in flight per process
    max_per_request: int = 4  # images of one request fetched at once
    max_per_host: int = 4  # downloads in flight from one host name
    cache_items: int = 256  # decoded images kept, by the digest of their bytes (0: no cache)
    cache_bytes: int = 512 * MiB  # their RGB pixel bytes (a 50 M-pixel image is 150 MB)
    max_images: int = 64  # per request
    formats: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # Pillow's plugin ids

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_concurrent", "max_per_request", "max_per_host"):
            _require_at_least(name, getattr(self, name), 1)
        for name in ("max_request_pixels", "decode_pixels"):  # room for the largest image
            _require_at_least(name, getattr(self, name), self.max_pixels)
        _require_at_least("max_images", self.max_images, 1)
        for name in ("max_redirects", "cache_items", "cache_bytes"):
            _require_at_least(name, getattr(self, name), 0)
        for name in ("fetch_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ImageLimits.{name} must be > 0, got {getattr(self, name)}")
        Image.init()  # registers every plugin Pillow has, so the ids can be checked
        if not self.formats or set(self.formats) - set(Image.OPEN):
            raise ValueError(f"ImageLimits.formats must be Pillow image ids, got {self.formats!r}")


def _require_at_least(name: str, value: int, floor: int) -> None:
    if value < floor:
        raise ValueError(f"ImageLimits.{name} must be >= {floor}, got {value}")


DEFAULT_LIMITS: Final = ImageLimits()


class ImageError(EngineContractError):
    """A request image that cannot reach the engine; the worker answers with a 400 and the message.

    ``index`` is the image's 0-based position in the request (the message counts from 1), None for
    a fault of the whole request (too many images); ``reason`` is a stable label for logs.
    """

    def __init__(self, message: str, *, reason: ImageFailure, index: int | None = None) -> None:
        super().__init__(message)
        self.reason: ImageFailure = reason
        self.index = index


@dataclass(frozen=True, slots=True)
class FetchedImage:
    """A decoded image and the identity the engine gets for it (``multi_modal_uuids``, ``mm_hashes``):
    the URL's uuid for a ``data:`` URL (the URL is the bytes), the URL's uuid and the bytes' digest
    for an http(s) one. Decoded images are cached and shared between requests: read-only."""

    image: Image.Image
    uuid: str


class _FaultError(Exception):
    """Why one image failed; ``public``: the detail may go to the client (it says nothing about what
    the worker reached), else the client reads only that the image could not be fetched."""

    def __init__(self, reason: ImageFailure, detail: str, *, public: bool = True) -> None:
        super().__init__(detail)
        self.reason: ImageFailure = reason
        self.detail = detail
        self.public = public


@dataclass(frozen=True, slots=True)
class _Http:
    url: str
    host: str


@dataclass(frozen=True, slots=True)
class _Data:
    url: str


_Source = _Http | _Data


class _Job:
    """One request's images: how many may be fetched at once, and the pixels they have left."""

    def __init__(self, images: Sequence[ImageRef], limits: ImageLimits) -> None:
        self.images = images
        self.slots = asyncio.Semaphore(limits.max_per_request)
        self.limit = limits.max_request_pixels
        self.pixels_left = limits.max_request_pixels

    def charge(self, width: int, height: int) -> None:
        pixels = width * height
        if pixels > self.pixels_left:
            raise _FaultError(
                "too_many_pixels",
                f"the image is {width}x{height} pixels: the request's images have more than the "
                f"{self.limit}-pixel limit of a request",
            )
        self.pixels_left -= pixels


class ImageFetcher:
    """Fetches and decodes request images, one per process; call ``aclose`` when done.

    ``policy``: where images may come from (the default: public addresses, any host name);
    ``resolve``: the host-name lookup (the default: the C library's, in threads of its own).
    """

    def __init__(
        self,
        limits: ImageLimits = DEFAULT_LIMITS,
        *,
        policy: MediaPolicy | None = None,
        resolve: Resolve | None = None,
    ) -> None:
        self.limits = limits
        self.policy = policy or MediaPolicy()
        self._client = checked_client(self.policy, limits.max_concurrent, limits.fetch_timeout_s, resolve)
        self._slots = asyncio.Semaphore(limits.max_concurrent)
        self._hosts: dict[str, _HostSlot] = {}
        self._decoding = _PixelBudget(limits.decode_pixels)
        self._cache = _ImageCache(limits.cache_items, limits.cache_bytes)

    async def fetch(self, images: Sequence[ImageRef]) -> list[FetchedImage]:
        """The request's images in order; any refusal is an ``ImageError`` naming the image."""
        self._check_count(len(images))
        sources = [self._parse(index, images) for index in range(len(images))]
        job = _Job(images, self.limits)
        tasks = [asyncio.ensure_future(self._one(job, index, s)) for index, s in enumerate(sources)]
        try:
            async with asyncio.timeout(self.limits.request_timeout_s) as scope:
                return list(await asyncio.gather(*tasks))
        except TimeoutError:
            if not scope.expired():
                raise
            index = next(index for index, task in enumerate(tasks) if not task.done() or task.cancelled())
            detail = f"the request's images were not all fetched within {self.limits.request_timeout_s:g} s"
            raise _refusal(index, images, _FaultError("timeout", detail, public=False)) from None
        finally:
            for task in tasks:  # after a failure, the rest are not needed
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Drop the cache and close the HTTP client (its connections and its lookup threads)."""
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
            source = _source(images[index].url)
            if isinstance(source, _Http):
                _check_target(httpx.URL(source.url), self.policy, first=True)
        except _FaultError as fault:
            raise _refusal(index, images, fault) from None
        return source

    async def _one(self, job: _Job, index: int, source: _Source) -> FetchedImage:
        timeout_s = self.limits.fetch_timeout_s
        try:
            async with job.slots:
                started = time.monotonic()
                async with asyncio.timeout(timeout_s):
                    fetched = await self._load(job, source)
        except TimeoutError:
            fault = _FaultError("timeout", f"not fetched and decoded within {timeout_s:g} s", public=False)
        except _FaultError as failed:
            fault = failed
        else:
            log.debug(
                "image_loaded",
                index=index,
                source="http" if isinstance(source, _Http) else "data",
                width=fetched.image.width,
                height=fetched.image.height,
                duration_ms=round((time.monotonic() - started) * 1000, 1),
            )
            return fetched
        raise _refusal(index, job.images, fault)

    async def _load(self, job: _Job, source: _Source) -> FetchedImage:
        if isinstance(source, _Http):
            data = await self._download(source)
            digest = await asyncio.to_thread(_sha256, data)
            uuid = fetched_image_uuid(image_uuid(source.url), digest)
        else:
            data, digest, uuid = await asyncio.to_thread(_data_image, source.url, self.limits.max_bytes)
        image = self._cache.get(digest)
        if image is not None:
            job.charge(image.width, image.height)
        else:
            image = await self._decode(job, data)
            self._cache.put(digest, image)
        return FetchedImage(image, uuid)

    async def _download(self, source: _Http) -> bytes:
        """The body at the URL: a slot of its host, then one of the process (both waits count
        against the image's deadline); what fails on the way is logged in full, and the client
        reads only that the image could not be fetched."""
        async with self._host_slot(source.host), self._slots:
            try:
                return await self._follow(source.url)
            except FetchRefusedError as fault:
                raise _FaultError(fault.reason, f"fetch failed: {fault}", public=False) from None
            except httpx.TimeoutException:
                raise _FaultError(
                    "timeout", f"fetch failed: no complete answer within {self.limits.fetch_timeout_s:g} s",
                    public=False,
                ) from None  # fmt: skip
            except httpx.HTTPError as exc:
                raise _FaultError("fetch_error", f"fetch failed: {_describe(exc)}", public=False) from None

    async def _follow(self, url: str) -> bytes:
        """The body at ``url`` after at most ``max_redirects`` redirects (whose bodies are never
        read), every target checked as the first URL was (its addresses when it connects)."""
        request = self._client.build_request("GET", url)
        for _ in range(self.limits.max_redirects + 1):
            response = await self._client.send(request, stream=True)
            try:
                if response.next_request is None:
                    return await _body(response, self.limits.max_bytes)
                request = response.next_request
                _check_target(request.url, self.policy, first=False)
            finally:
                await response.aclose()
        detail = f"fetch failed: more than {self.limits.max_redirects} redirects"
        raise _FaultError("too_many_redirects", detail, public=False)

    async def _decode(self, job: _Job, data: bytes) -> Image.Image:
        """The header read (in a thread), its pixels charged to the request, then decoded in a thread
        once the process has room; that room is freed when the thread ends, even after a timeout."""
        opened = await asyncio.to_thread(_open, data, self.limits)
        try:
            job.charge(*opened.image.size)
            pixels = opened.image.width * opened.image.height
            await self._decoding.take(pixels)
        except BaseException:
            opened.close()
            raise
        decoding = asyncio.ensure_future(asyncio.to_thread(_rgb, opened))
        decoding.add_done_callback(lambda task: self._decoded(task, pixels))
        return await asyncio.shield(decoding)  # a deadline leaves the thread to finish

    def _decoded(self, task: asyncio.Future[Image.Image], pixels: int) -> None:
        self._decoding.give(pixels)
        if not task.cancelled():
            task.exception()  # retrieved: a waiter that left cannot

    def _host_slot(self, host: str) -> _HostSlot:
        slot = self._hosts.get(host)
        if slot is None:
            slot = _HostSlot(self.limits.max_per_host, lambda: self._hosts.pop(host, None))
            self._hosts[host] = slot
        return slot


class _HostSlot:
    """A semaphore of one host name, dropped from the fetcher's table when nobody holds or waits."""

    def __init__(self, size: int, on_idle: Callable[[], object]) -> None:
        self._semaphore = asyncio.Semaphore(size)
        self._users = 0
        self._on_idle = on_idle

    async def __aenter__(self) -> None:
        self._users += 1
        try:
            await self._semaphore.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *_: object) -> None:
        self._semaphore.release()
        self._leave()

    def _leave(self) -> None:
        self._users -= 1
        if self._users == 0:
            self._on_idle()


class _PixelBudget:
    """Pixels being decoded at once: ``take`` waits (first come, first served) until there is room."""

    def __init__(self, limit: int) -> None:
        self._free = limit
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, pixels: int) -> None:
        if not self._waiting and pixels <= self._free:
            self._free -= pixels
            return
        entry = (pixels, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self.give(pixels)  # granted as it was cancelled: handed on
            else:
                self._waiting.remove(entry)
                self._wake()
            raise

    def give(self, pixels: int) -> None:
        self._free += pixels
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self._free:
            pixels, future = self._waiting.popleft()
            if not future.done():
                self._free -= pixels
                future.set_result(None)


class _ImageCache:
    """Decoded images by the digest of their bytes, least recently used first out, bounded by count
    and by pixel bytes."""

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
    if fault.public:
        message = f"image {index + 1} of {len(images)} ({url}): {fault.detail}"
    else:
        message = f"image {index + 1} could not be fetched"
    return ImageError(message, reason=fault.reason, index=index)


def _source(url: str) -> _Source:
    """What an accepted URL reads; any other string fails here and never reaches an engine."""
    if url.startswith("data:"):
        header, comma, _ = url.partition(",")
        if not comma or not _DATA_HEADER.fullmatch(header):
            raise _FaultError(
                "bad_data_url", "a data: image URL must be data:image/<type>;base64,<base64 data>"
            )
        return _Data(url)
    if url.startswith(("http://", "https://")):
        return _Http(url, _http_host(url))
    raise _FaultError(
        "unsupported_url", "not an accepted image URL: only http(s) URLs and base64 data:image URLs are"
    )


def _http_host(url: str) -> str:
    try:
        host = urlsplit(url).hostname if not _UNSAFE_URL_CHARS.search(url) else None
        checked = httpx.URL(url).host if host else ""
    except (ValueError, httpx.InvalidURL):
        checked = ""
    if not checked:
        raise _FaultError("bad_url", "not a valid http(s) URL (a host, no spaces or control characters)")
    return normal_host(checked)


def _check_target(url: httpx.URL, policy: MediaPolicy, *, first: bool) -> None:
    """A URL the worker is about to ask for: http(s), no credentials, a host the policy allows. The
    first URL's faults are the client's to read; a redirect's are part of the fetch."""
    if url.scheme not in ("http", "https"):
        raise _FaultError("bad_redirect", f"fetch failed: redirected to a {url.scheme}: URL", public=False)
    if url.userinfo:
        detail = "a URL with credentials (user:password@host) is not fetched"
        detail = detail if first else f"fetch failed: redirected to {detail}"
        raise _FaultError("credentials", detail, public=first)
    refused = policy.host_refusal(url.host)
    if refused is not None:
        detail = refused if first else f"fetch failed: redirected: {refused}"
        raise _FaultError("domain_not_allowed", detail, public=first)


async def _body(response: httpx.Response, max_bytes: int) -> bytes:
    """A 2xx response's body, read no further than ``max_bytes`` (the bytes as sent: identity was
    asked for, so no decompression can inflate them past the cap)."""
    if not response.is_success:
        raise _FaultError("http_status", f"fetch failed: HTTP {response.status_code}", public=False)
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _data_image(url: str, max_bytes: int) -> tuple[bytes, str, str]:
    """A data: URL's bytes, their digest and the URL's uuid (in a thread: all three are CPU work)."""
    payload = url.partition(",")[2]
    if _SPACE.search(payload):  # the frontend allows line breaks in base64
        payload = "".join(payload.split())
    if len(payload) * 3 // 4 - payload[-2:].count("=") > max_bytes:
        raise _too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except ValueError:
        raise _FaultError("bad_data_url", "the data: URL's payload is not valid base64") from None
    return data, _sha256(data), image_uuid(url)


@dataclass(frozen=True, slots=True)
class _Opened:
    """An image whose header is read, and the encoded bytes Pillow reads its pixels from."""

    image: Image.Image
    source: io.BytesIO

    def close(self) -> None:
        self.image.close()
        self.source.close()


def _open(data: bytes, limits: ImageLimits) -> _Opened:
    """The image with its header read and its pixel count checked, not decoded (in a thread)."""
    source = io.BytesIO(data)
    try:
        image = Image.open(source, formats=limits.formats)
    except Image.DecompressionBombError:
        raise _FaultError(
            "too_many_pixels", f"the image has more pixels than the {limits.max_pixels}-pixel limit"
        ) from None
    except UnidentifiedImageError:
        accepted = ", ".join(limits.formats)
        raise _FaultError("not_an_image", f"not an image in an accepted format ({accepted})") from None
    except Exception as exc:  # Pillow's plugins raise many types on a corrupt header
        raise _FaultError("decode_failed", f"the image could not be decoded: {_describe(exc)}") from None
    opened = _Opened(image, source)
    width, height = image.size
    if width * height > limits.max_pixels:
        opened.close()
        raise _FaultError(
            "too_many_pixels",
            f"the image is {width}x{height} pixels, more than the {limits.max_pixels}-pixel limit",
        )
    return opened


def _rgb(opened: _Opened) -> Image.Image:
    """RGB pixels (in a thread): an RGB image as decoded, no copy; transparency composited onto white
    as vLLM's own loader does, in one paste with the alpha band as the mask (no copy of the band).
    The encoded bytes are let go either way (PNG and TIFF images keep their reader)."""
    image, kept = opened.image, False
    try:
        image.load()
        if image.mode == "RGB" and not getattr(image, "is_animated", False):
            kept = True  # loaded, its file let go (an animated image keeps it for its frames)
            return image
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            with_alpha = image if image.mode == "RGBA" else image.convert("RGBA")
            canvas = Image.new("RGB", image.size, _WHITE)
            canvas.paste(with_alpha, mask=with_alpha)
            return canvas
        return image.convert("RGB")
    except Exception as exc:  # Pillow's decoders raise many types on corrupt data
        raise _FaultError("decode_failed", f"the image could not be decoded: {_describe(exc)}") from None
    finally:
        opened.source.close()
        if not kept:
            image.close()


def _too_large(max_bytes: int) -> _FaultError:
    return _FaultError("too_large", f"the image is larger than the {max_bytes}-byte limit")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:DETAIL_CHARS] if text else type(exc).__name__
