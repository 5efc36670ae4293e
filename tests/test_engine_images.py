"""The worker's image fetcher against a real HTTP server on loopback: what it accepts, bounds, caches.

The server runs in the test's own event loop (``support.images.ImageServer``); requests are counted
on the server side, and blocking routes wait for permits the test hands out, so every wait is on a
condition, never on time. The fetchers here may fetch from loopback (``LOOPBACK_POLICY``); what a
worker may not fetch from by default is tests/test_hostile_media.py's.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import ipaddress
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from PIL import Image
from support.images import (
    BLUE,
    CAT_PNG,
    GREEN,
    GREEN_PNG,
    LOOPBACK_POLICY,
    RED,
    ImageServer,
    data_url,
    encoded,
)
from support.logs import Logs, find, until

from dynamo_prep.engines.images import ImageError, ImageFetcher, ImageLimits, clip_url
from dynamo_prep.protocol.preprocessed import ImageRef, fetched_image_uuid, image_uuid

DEADLINE_S = 10.0
MakeFetcher = Callable[..., ImageFetcher]


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
        fetchers.append(ImageFetcher(ImageLimits(**limits), policy=LOOPBACK_POLICY))
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


async def images_of(fetcher: ImageFetcher, images: list[ImageRef]) -> list[Image.Image]:
    return [fetched.image for fetched in await asyncio.wait_for(fetcher.fetch(images), DEADLINE_S)]


# --- what is accepted, in order ---


async def test_order_is_kept_across_http_and_data_urls(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    images = await images_of(
        fetcher,
        [
            ref(server.url("/cat.png"), "cat"),
            ref(data_url(GREEN_PNG), "green"),
            ref(server.url("/dog.jpg"), "dog"),
            ref(data_url(encoded((2, 7), BLUE, "JPEG"), "jpeg"), "small-jpeg"),
        ],
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
    opaque, transparent = await images_of(make_fetcher(), images)
    assert opaque.mode == transparent.mode == "RGB"
    assert opaque.getpixel((0, 0)) == RED
    assert transparent.getpixel((0, 0)) == (255, 255, 255)


async def test_redirects_up_to_the_limit_are_followed(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    (image,) = await images_of(make_fetcher(max_redirects=3), [ref(server.url("/hop/3"))])
    assert image.size == (3, 2)
    assert server.hits["/cat.png"] == 1


async def test_a_resolver_names_the_address_and_the_host_stays_the_url_s(server: ImageServer) -> None:
    """The lookup is the fetcher's own, once per connection: the connection goes to the address it
    returned, and the Host header (and TLS's name, for https) is the URL's."""
    looked_up: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[Any]:
        looked_up.append((host, port))
        return [ipaddress.ip_address("127.0.0.1")]

    fetcher = ImageFetcher(policy=LOOPBACK_POLICY, resolve=resolve)
    try:
        (fetched,) = await fetcher.fetch([ref(f"http://images.test:{server.port}/cat.png")])
    finally:
        await fetcher.aclose()
    assert fetched.image.size == (3, 2)
    assert looked_up == [("images.test", server.port)]
    assert server.hosts == [f"images.test:{server.port}"]


async def test_the_engine_s_uuid_is_the_url_s_and_the_bytes_for_http_and_the_url_s_for_data(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    cat, green = server.url("/cat.png"), data_url(GREEN_PNG)
    fetched = await make_fetcher().fetch([ref(cat), ref(green)])
    digest = hashlib.sha256(CAT_PNG).hexdigest()
    assert [image.uuid for image in fetched] == [
        fetched_image_uuid(image_uuid(cat), digest),
        image_uuid(green),
    ]


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


async def test_an_http_error_status_is_not_fetched_for_the_client_and_logged_in_full(
    logs: Logs, server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(make_fetcher(), [ref(server.url("/cat.png")), ref(server.url("/missing"))])
    assert str(error) == "image 2 could not be fetched"
    assert (error.index, error.reason) == (1, "http_status")
    (line,) = find(logs, "image_fetch_failed")
    assert line["detail"] == "fetch failed: HTTP 404"


async def test_messages_never_carry_query_strings_or_credentials(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    url = f"http://user:hunter2@127.0.0.1:{server.port}/cat.png?signature=s3cr3t"
    error = await refusal(make_fetcher(), [ref(url)])
    assert str(error) == (
        f"image 1 of 1 (http://127.0.0.1:{server.port}/cat.png?…): "
        "a URL with credentials (user:password@host) is not fetched"
    )
    assert server.hits == Counter()  # credentials are never sent (httpx would send them as Basic auth)


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
    assert sum(server.hits.values()) == 4  # the request and three redirects; the fourth is not followed
    assert server.hits["/cat.png"] == 0


async def test_a_redirect_to_another_scheme_is_refused(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    error = await refusal(make_fetcher(), [ref(server.url("/to-file"))])
    assert error.reason == "bad_redirect"
    assert str(error) == "image 1 could not be fetched"


async def test_a_fetch_that_never_finishes_times_out(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    error = await refusal(make_fetcher(fetch_timeout_s=0.5), [ref(server.url("/slow"))])
    assert error.reason == "timeout"
    assert str(error) == "image 1 could not be fetched"


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
    await refusal(make_fetcher(), [ref(server.url("/cat.png")), ref(server.url("/broken?token=x"))])
    (line,) = find(logs, "image_fetch_failed")
    assert line["reason"] == "http_status"
    assert line["detail"] == "fetch failed: HTTP 500"
    assert (line["index"], line["count"]) == (1, 2)
    assert line["url"] == server.url("/broken?…")
    assert line["log_level"] == "warning"


# --- the cache: decoded images by their bytes ---


async def test_an_http_image_is_fetched_every_time_and_decoded_once(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    (first,) = await images_of(fetcher, [ref(server.url("/cat.png"))])
    (again,) = await images_of(fetcher, [ref(server.url("/cat.png"))])
    assert again is first  # the same bytes: the decoded image is reused
    assert server.hits["/cat.png"] == 2  # but the URL is asked again: its image may have changed


async def test_the_same_bytes_at_two_urls_are_decoded_once(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    server.serve("/also-cat.png", CAT_PNG)
    fetcher = make_fetcher()
    (first,) = await fetcher.fetch([ref(server.url("/cat.png"))])
    (second,) = await fetcher.fetch([ref(server.url("/also-cat.png"))])
    assert second.image is first.image
    assert first.uuid != second.uuid  # two URLs, two routing names: the engine tells them apart by URL too
    assert first.uuid.split("-")[1] == second.uuid.split("-")[1]


async def test_the_cache_is_bounded_by_items(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(cache_items=1)
    (cat,) = await images_of(fetcher, [ref(server.url("/cat.png"))])
    await fetcher.fetch([ref(server.url("/dog.jpg"))])  # evicts the cat
    (again,) = await images_of(fetcher, [ref(server.url("/cat.png"))])
    assert again is not cat


async def test_the_cache_is_bounded_by_pixel_bytes(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(cache_bytes=8 * 8 * 3)  # room for the dog (8x8 RGB) alone
    (cat,) = await images_of(fetcher, [ref(server.url("/cat.png"))])
    (dog,) = await images_of(fetcher, [ref(server.url("/dog.jpg"))])  # evicts the cat
    assert (await images_of(fetcher, [ref(server.url("/dog.jpg"))]))[0] is dog
    assert (await images_of(fetcher, [ref(server.url("/cat.png"))]))[0] is not cat


async def test_a_failed_fetch_is_not_cached(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    error = await refusal(fetcher, [ref(server.url("/flaky/a"))])
    assert error.reason == "http_status"
    (image,) = await images_of(fetcher, [ref(server.url("/flaky/a"))])
    assert image.size == (3, 2)
    assert server.hits["/flaky/a"] == 2


# --- how many downloads run at once ---


async def test_at_most_max_concurrent_fetches_are_in_flight(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(max_concurrent=2, max_per_request=5, max_per_host=5)
    count = 5
    request = asyncio.create_task(fetcher.fetch([ref(server.url(f"/gated/c{n}")) for n in range(count)]))
    for arrived in range(2, count + 1):  # each released answer lets exactly one more request in
        await until(requests_reach(server, arrived), f"{arrived} requests")
        server.release()
    server.release()
    images = await asyncio.wait_for(request, DEADLINE_S)
    assert len(images) == count
    assert server.max_in_flight == 2


async def test_one_request_fetches_at_most_max_per_request_at_once(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(max_per_request=2)
    request = asyncio.create_task(fetcher.fetch([ref(server.url(f"/gated/r{n}")) for n in range(4)]))
    other = asyncio.create_task(fetcher.fetch([ref(server.url("/gated/other"))]))
    await until(requests_reach(server, 3), "two of the request's and the other's")
    assert server.max_in_flight == 3
    server.release(4)
    await until(requests_reach(server, 5), "the request's last two")
    server.release(2)
    assert len(await asyncio.wait_for(request, DEADLINE_S)) == 4
    await asyncio.wait_for(other, DEADLINE_S)
    assert server.max_in_flight <= 3


async def test_one_host_gets_at_most_max_per_host_downloads_and_others_go_on(
    server: ImageServer, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(max_per_host=2)
    requests = [asyncio.create_task(fetcher.fetch([ref(server.url(f"/gated/h{n}"))])) for n in range(3)]
    await until(requests_reach(server, 2), "two downloads from 127.0.0.1")
    # the same server under another host name is another host: it is not held up
    (image,) = await images_of(fetcher, [ref(server.url("/cat.png", host="localhost"))])
    assert image.size == (3, 2)
    assert server.max_in_flight == 2
    server.release()
    await until(requests_reach(server, 4), "the third download from 127.0.0.1")
    server.release(2)
    await asyncio.wait_for(asyncio.gather(*requests), DEADLINE_S)
    assert server.max_in_flight == 2


async def test_a_request_s_images_share_one_deadline(server: ImageServer, make_fetcher: MakeFetcher) -> None:
    """Each image has its own time once it starts; all of them together have the request's."""
    fetcher = make_fetcher(max_per_request=1, fetch_timeout_s=60, request_timeout_s=0.5)
    error = await refusal(fetcher, [ref(server.url("/cat.png")), ref(server.url("/hang"))])
    assert (error.index, error.reason) == (1, "timeout")
    assert str(error) == "image 2 could not be fetched"


# --- limits ---


@pytest.mark.parametrize(
    "limits",
    [
        {"max_bytes": 0},
        {"max_pixels": 0},
        {"fetch_timeout_s": 0},
        {"max_redirects": -1},
        {"max_concurrent": 0},
        {"max_per_request": 0},
        {"max_per_host": 0},
        {"request_timeout_s": 0},
        {"max_request_pixels": 10, "max_pixels": 11},
        {"decode_pixels": 10, "max_pixels": 11},
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
