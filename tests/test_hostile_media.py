"""Issue 25, rows 3, 5, 7 and 13: request images as an attacker sends them, against the worker's fetcher.

Every server is a real HTTP server on loopback, and nothing leaves the machine: the address ranges
no test may reach (cloud metadata, private networks, link-local) are checked against the address
check itself, and names that would need DNS are resolved by a resolver the test controls. A worker
fetches from public addresses only unless ``--allowed-media-networks`` lets it (``LOOPBACK_POLICY``
here, for the tests that need a server to answer).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import socket
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from support.cluster import Cluster, mock_cluster
from support.images import (
    BLUE,
    CAT_PNG,
    GREEN,
    LOOPBACK_POLICY,
    RED,
    ImageServer,
    data_url,
    encoded,
    png_header,
    served_images,
)
from support.logs import Logs, find, until
from support.plane import wait_for

from dynamo_prep.cli import parse_args
from dynamo_prep.engines.images import DEFAULT_LIMITS, FetchedImage, ImageError, ImageFetcher, ImageLimits
from dynamo_prep.engines.media_policy import Address, MediaPolicy, numeric_addresses
from dynamo_prep.protocol.kv_events import BlockStored, ImageSpan
from dynamo_prep.protocol.preprocessed import ImageRef, fetched_image_uuid, image_uuid, routing_image_uuid
from dynamo_prep.routing.hashing import request_block_hashes, stored_block_hashes
from dynamo_prep.worker.config import WorkerConfig

DEADLINE_S = 20.0
NOT_FETCHED = "image 1 could not be fetched"
NOT_A_PICTURE = data_url(b"not a picture at all")


@pytest.fixture
async def server() -> AsyncIterator[ImageServer]:
    image_server = ImageServer("127.0.0.1")
    await image_server.start()
    yield image_server
    await image_server.close()


@pytest.fixture
async def server6() -> AsyncIterator[ImageServer]:
    image_server = ImageServer("::1")
    await image_server.start()
    yield image_server
    await image_server.close()


@pytest.fixture
async def fetchers() -> AsyncIterator[list[ImageFetcher]]:
    made: list[ImageFetcher] = []
    yield made
    for fetcher in made:
        await fetcher.aclose()


def fetcher_of(made: list[ImageFetcher], policy: MediaPolicy | None = None, **options: Any) -> ImageFetcher:
    limits = options.pop("limits", DEFAULT_LIMITS)
    made.append(ImageFetcher(limits, policy=policy, **options))
    return made[-1]


def ref(url: str) -> ImageRef:
    return ImageRef(url=url, uuid=image_uuid(url))


async def fetched(fetcher: ImageFetcher, *urls: str) -> list[FetchedImage]:
    return await asyncio.wait_for(fetcher.fetch([ref(url) for url in urls]), DEADLINE_S)


async def refusal(fetcher: ImageFetcher, *urls: str) -> ImageError:
    with pytest.raises(ImageError) as caught:
        await fetched(fetcher, *urls)
    return caught.value


def only(address: str) -> Address:
    found = numeric_addresses(address)
    assert found is not None and len(found) == 1, address
    return found[0]


# --- row 3: where images are fetched from ---------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "2130706433", "0x7f000001", "127.1", "0.0.0.0", "[::ffff:127.0.0.1]"]
)
async def test_this_host_is_not_fetched_from_in_any_spelling(
    host: str, server: ImageServer, fetchers: list[ImageFetcher], logs: Logs
) -> None:
    error = await refusal(fetcher_of(fetchers), server.url("/cat.png", host=host))
    assert (str(error), error.reason) == (NOT_FETCHED, "address_refused")
    assert server.hits == Counter()  # refused before any connection
    (line,) = find(logs, "image_fetch_failed")
    assert "is not a public address" in line["detail"] or "is not a unicast address" in line["detail"]


async def test_ipv6_loopback_is_not_fetched_from(server6: ImageServer, fetchers: list[ImageFetcher]) -> None:
    error = await refusal(fetcher_of(fetchers), server6.url("/cat.png"))
    assert (str(error), error.reason) == (NOT_FETCHED, "address_refused")
    assert server6.hits == Counter()
    # the same server, once loopback is allowed: it was reachable all along
    (image,) = await fetched(fetcher_of(fetchers, LOOPBACK_POLICY), server6.url("/cat.png"))
    assert image.image.size == (3, 2)


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # cloud metadata (AWS, GCP, Azure)
        "fd00:ec2::254",  # AWS's IPv6 metadata
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",  # carrier-grade NAT
        "fe80::1%eth0",
        "::1",
        "0.0.0.0",
        "::",
        "224.0.0.1",
        "255.255.255.255",
        "::ffff:169.254.169.254",  # IPv4-mapped
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "017700000001",  # octal 127.0.0.1
        "0x7f.1",
        "0",
    ],
)
def test_addresses_that_are_not_public_are_refused(address: str) -> None:
    assert MediaPolicy().address_refusal(only(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert MediaPolicy().address_refusal(only(address)) is None


def test_the_opt_in_allows_its_networks_and_nothing_else() -> None:
    policy = MediaPolicy.from_options(None, ["10.0.0.0/8", "fd00::/8"])
    assert policy.address_refusal(only("10.1.2.3")) is None
    assert policy.address_refusal(only("::ffff:10.1.2.3")) is None  # the same address, mapped
    assert policy.address_refusal(only("fd00:ec2::254")) is None
    for refused in ("169.254.169.254", "192.168.1.1", "127.0.0.1", "0.0.0.0"):
        assert policy.address_refusal(only(refused)) is not None, refused
    assert MediaPolicy.from_options(None, ["0.0.0.0/0"]).address_refusal(only("0.0.0.0")) is not None


async def test_a_name_is_refused_when_it_resolves_to_a_private_address(
    fetchers: list[ImageFetcher], logs: Logs
) -> None:
    asked: list[str] = []
    answers = {
        "metadata.google.internal": ["169.254.169.254"],
        "mixed.test": ["93.184.215.14", "10.0.0.7"],  # one private answer is enough
        "rebind.test": ["::ffff:127.0.0.1"],
    }

    async def resolve(host: str, port: int) -> list[Address]:
        asked.append(host)
        return [ipaddress.ip_address(address) for address in answers[host]]

    fetcher = fetcher_of(fetchers, resolve=resolve)
    for host in answers:
        error = await refusal(fetcher, f"http://{host}/computeMetadata/v1/")
        assert (str(error), error.reason) == (NOT_FETCHED, "address_refused")
    assert asked == list(answers)  # resolved once each, and never connected (nothing listens there)
    details = [line["detail"] for line in find(logs, "image_fetch_failed")]
    assert "169.254.169.254 is not a public address" in details[0]
    assert "10.0.0.7 is not a public address" in details[1]


async def test_numeric_hosts_are_read_as_the_c_library_reads_them_never_resolved(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    async def resolve(host: str, port: int) -> list[Address]:
        raise AssertionError(f"{host} was looked up")

    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY, resolve=resolve)
    for host in ("2130706433", "0x7f000001", "127.1", "[::ffff:127.0.0.1]"):
        (image,) = await fetched(fetcher, server.url("/cat.png", host=host))
        assert image.image.size == (3, 2)


async def test_credentials_in_a_url_are_refused_and_never_sent(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY)
    error = await refusal(fetcher, f"http://admin:hunter2@127.0.0.1:{server.port}/cat.png")
    assert error.reason == "credentials"
    assert "hunter2" not in str(error) and "admin" not in str(error)
    server.redirect("/login", f"http://admin:hunter2@127.0.0.1:{server.port}/cat.png")
    error = await refusal(fetcher, server.url("/login"))
    assert (str(error), error.reason) == (NOT_FETCHED, "credentials")
    assert server.hits == Counter({"/login": 1})  # the redirect's target was never asked for


async def test_every_redirect_hop_is_checked_like_the_first_url(fetchers: list[ImageFetcher]) -> None:
    """A host the worker may fetch from (127.0.0.2 here) redirects into one it may not (127.0.0.1)."""
    inside, outside = ImageServer("127.0.0.1"), ImageServer("127.0.0.2")
    await inside.start()
    await outside.start()
    try:
        outside.redirect("/innocent.png", inside.url("/cat.png"))
        policy = MediaPolicy.from_options(None, ["127.0.0.2/32"])
        error = await refusal(fetcher_of(fetchers, policy), outside.url("/innocent.png"))
        assert (str(error), error.reason) == (NOT_FETCHED, "address_refused")
        assert (outside.hits["/innocent.png"], inside.hits) == (1, Counter())
        # both allowed: the same redirect is followed
        both = MediaPolicy.from_options(None, ["127.0.0.1/32", "127.0.0.2/32"])
        (image,) = await fetched(fetcher_of(fetchers, both), outside.url("/innocent.png"))
        assert image.image.size == (3, 2)
    finally:
        await inside.close()
        await outside.close()


async def test_the_domain_allow_list_is_checked_for_the_url_and_every_redirect(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    policy = MediaPolicy.from_options(["LOCALHOST."], ["127.0.0.0/8"])  # as written by an operator
    fetcher = fetcher_of(fetchers, policy)
    (image,) = await fetched(fetcher, server.url("/cat.png", host="localhost"))
    assert image.image.size == (3, 2)
    error = await refusal(fetcher, server.url("/cat.png"))  # 127.0.0.1 is not a listed name
    assert error.reason == "domain_not_allowed"
    assert str(error).endswith("the host '127.0.0.1' is not one of the worker's allowed media domains")
    server.redirect("/away", server.url("/cat.png"))
    error = await refusal(fetcher, server.url("/away", host="localhost"))
    assert (str(error), error.reason) == (NOT_FETCHED, "domain_not_allowed")
    assert server.hits == Counter({"/cat.png": 1, "/away": 1})


@pytest.mark.parametrize("path", ["/secret", "/broken", "/missing", "/hang", "/closed", "/unresolvable"])
async def test_a_scanner_reads_the_same_message_whatever_the_worker_met(
    path: str, server: ImageServer, fetchers: list[ImageFetcher], logs: Logs
) -> None:
    """401, 500, 404, no answer, a closed port, a name that does not resolve: one message each, the
    detail in the worker's log only (even where the operator allowed the network)."""
    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        urls = {
            "/closed": f"http://127.0.0.1:{closed.getsockname()[1]}/x.png",
            "/unresolvable": "http://no-such-host.test/x.png",
        }

        async def resolve(host: str, port: int) -> list[Address]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        limits = ImageLimits(fetch_timeout_s=1.0)
        fetcher = fetcher_of(fetchers, LOOPBACK_POLICY, resolve=resolve, limits=limits)
        error = await refusal(fetcher, urls.get(path, server.url(path)))
    assert str(error) == NOT_FETCHED
    (line,) = find(logs, "image_fetch_failed")
    assert line["detail"] != NOT_FETCHED and line["detail"].startswith(("fetch failed", "not fetched"))


def test_the_worker_takes_the_media_flags_for_every_engine() -> None:
    """``--allowed-media-domains`` (vLLM's name) is the worker's, not passed on to vLLM's parser."""
    args = parse_args(
        ["worker", "--model-path", "m", "--discovery", "tcp://x:1", "--engine", "vllm",
         "--allowed-media-domains", "images.example", "cdn.example,other.example", "--seed", "3",
         "--allowed-media-networks", "10.0.0.0/8"]
    )  # fmt: skip
    assert args.engine_args == ["--seed", "3"]
    config = WorkerConfig.from_options(
        model_path="kimi-k3-demo",
        discovery=["tcp://x:1"],
        allowed_media_domains=["images.example", "CDN.example."],
        allowed_media_networks=["10.0.0.0/8"],
    )
    assert config.media.allowed_domains == frozenset({"images.example", "cdn.example"})
    assert config.media.allowed_networks == (ipaddress.ip_network("10.0.0.0/8"),)
    assert (
        WorkerConfig.from_options(model_path="kimi-k3-demo", discovery=["tcp://x:1"]).media == MediaPolicy()
    )
    for option, value, flag in (
        ("allowed_media_domains", ["http://images.example/"], "--allowed-media-domains"),
        ("allowed_media_domains", [], "--allowed-media-domains"),
        ("allowed_media_networks", ["10.0.0.0/33"], "--allowed-media-networks"),
    ):
        with pytest.raises(ValueError, match=flag):
            WorkerConfig.from_options(model_path="kimi-k3-demo", discovery=["tcp://x:1"], **{option: value})


@pytest.fixture(scope="module")
def picture() -> Iterator[str]:
    with served_images({"/cat.png": CAT_PNG}) as base:
        yield base


@pytest.fixture(scope="module")
def strict_and_open(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A frontend and two mock workers of the demo model under two names: ``strict`` has the
    default policy, ``open`` may fetch from 127.0.0.1."""
    demo = ("--model-path", "kimi-k3-demo")
    workers = [
        (*demo, "--served-name", "strict"),
        (*demo, "--served-name", "open", "--allowed-media-networks", "127.0.0.1/32"),
    ]
    with mock_cluster(tmp_path_factory.mktemp("media"), workers) as cluster:
        wait_for(lambda: len(cluster.frontend.find("model_added")) >= 2, 30, message="both names served")
        yield cluster


def chat(model: str, url: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8}


def test_a_mock_worker_fetches_through_the_same_policy(strict_and_open: Cluster, picture: Any) -> None:
    url = f"{picture}/cat.png"
    with httpx.Client(trust_env=False, timeout=30) as http:
        refused = http.post(f"{strict_and_open}/v1/chat/completions", json=chat("strict", url))
        assert picture.hits == Counter()
        served = http.post(f"{strict_and_open}/v1/chat/completions", json=chat("open", url))
        broken = http.post(f"{strict_and_open}/v1/chat/completions", json=chat("open", NOT_A_PICTURE))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"] == f"the engine refused the request: {NOT_FETCHED}"
    assert served.status_code == 200, served.text
    assert picture.hits == Counter({"/cat.png": 1})
    assert broken.status_code == 400  # a client's own bytes: what is wrong with them is said
    assert "image 1 of 1 (data:image/png;base64,…): not an image" in broken.json()["error"]["message"]


# --- row 5: requests whose images never answer ----------------------------------------------------


async def test_a_request_is_served_while_others_hang_on_their_images(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    """Two requests of 64 images that never answer, then one with a small picture from another host:
    it is served while they still hang (their deadline here is a minute)."""
    limits = ImageLimits(fetch_timeout_s=60, request_timeout_s=120)
    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY, limits=limits)
    hanging = [
        asyncio.create_task(fetcher.fetch([ref(server.url(f"/hang?{r}-{i}")) for i in range(64)]))
        for r in range(2)
    ]
    await until(lambda: server.in_flight >= min(limits.max_per_host, 2 * limits.max_per_request), "hangs")
    (victim,) = await fetched(fetcher, server.url("/cat.png", host="localhost"))
    assert victim.image.size == (3, 2)
    assert not any(task.done() for task in hanging)  # served while they hang
    for task in hanging:
        task.cancel()
    await asyncio.gather(*hanging, return_exceptions=True)


# --- row 7: pixels ----------------------------------------------------------------------------------


async def test_a_request_s_pixels_are_counted_from_headers_before_decoding(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    """Two 100x100 pictures fill the request's budget; the third is refused from its header alone
    (it has no pixel data: decoding it would fail otherwise)."""
    server.serve("/a.png", encoded((100, 100), RED))
    server.serve("/b.png", encoded((100, 100), BLUE))
    server.serve("/header-only.png", png_header(100, 100))
    limits = ImageLimits(
        max_pixels=10_000, max_request_pixels=20_000, decode_pixels=10_000, max_per_request=1
    )
    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY, limits=limits)
    error = await refusal(fetcher, server.url("/a.png"), server.url("/b.png"), server.url("/header-only.png"))
    assert (error.index, error.reason) == (2, "too_many_pixels")
    assert "the request's images have more than the 20000-pixel limit of a request" in str(error)
    # each request has its own budget, and the process's decode room came back every time
    for path in ("/a.png", "/b.png"):
        (image,) = await fetched(fetcher, server.url(path))
        assert image.image.size == (100, 100)


async def test_the_issue_s_large_pngs_are_refused_from_their_headers_under_the_default_limits(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    """Row 7's request: PNGs of 7071x7071, each under the 50 M-pixel limit of one image. A request
    holds at most 64 M pixels: after a 4000x4000 picture, the next header is refused (it has no
    pixel data: only its header could refuse it). One image at a time here, so the order is known."""
    server.serve("/16m.png", encoded((4000, 4000), GREEN))
    server.serve("/large.png", png_header(7071, 7071))
    urls = [server.url("/16m.png"), *(server.url(f"/large.png?{n}") for n in range(7))]
    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY, limits=ImageLimits(max_per_request=1))
    error = await refusal(fetcher, *urls)
    assert (error.index, error.reason) == (1, "too_many_pixels")
    assert "7071x7071" in str(error)


async def test_decodes_wait_for_room_and_every_one_gives_it_back(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    """Room for one decode in the whole process: eight requests at once are all served, in turn."""
    for n in range(8):
        server.serve(f"/p{n}.png", encoded((64, 64), (n * 30, 0, 0)))
    limits = ImageLimits(max_pixels=64 * 64, max_request_pixels=64 * 64, decode_pixels=64 * 64)
    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY, limits=limits)
    results = await asyncio.gather(*(fetched(fetcher, server.url(f"/p{n}.png")) for n in range(8)))
    assert [image.image.getpixel((0, 0)) for (image,) in results] == [(n * 30, 0, 0) for n in range(8)]


async def test_a_transparent_image_is_composited_onto_white(fetchers: list[ImageFetcher]) -> None:
    half = encoded((4, 4), (255, 0, 0, 128), mode="RGBA")
    (image,) = await fetched(fetcher_of(fetchers), data_url(half))
    assert image.image.mode == "RGB"
    assert image.image.getpixel((0, 0)) == (255, 127, 127)


# --- row 13: an image is its bytes ------------------------------------------------------------------


async def test_a_changed_image_at_the_same_url_is_the_new_image(
    server: ImageServer, fetchers: list[ImageFetcher]
) -> None:
    fetcher = fetcher_of(fetchers, LOOPBACK_POLICY)
    url = server.url("/photo.png")
    server.serve("/photo.png", encoded((4, 4), RED))
    (before,) = await fetched(fetcher, url)
    server.serve("/photo.png", encoded((4, 4), BLUE))
    (after,) = await fetched(fetcher, url)
    assert (before.image.getpixel((0, 0)), after.image.getpixel((0, 0))) == (RED, BLUE)
    # the engine's caches (vLLM's multi_modal_uuids) see two images; the router, one URL
    assert before.uuid != after.uuid
    assert after.uuid == fetched_image_uuid(
        image_uuid(url), hashlib.sha256(encoded((4, 4), BLUE)).hexdigest()
    )
    assert routing_image_uuid(before.uuid) == routing_image_uuid(after.uuid) == image_uuid(url)


def test_the_router_matches_blocks_an_engine_stored_under_a_fetched_image_s_uuid() -> None:
    """The engine's KV events name the image by URL and bytes; the router, which never sees the
    bytes, names it by URL: the blocks still match, for any bytes."""
    url = "https://images.example/cat.png"
    tokens, block = list(range(64)), 16
    requested = request_block_hashes(tokens, block, [ImageSpan(image_uuid(url), 20, 8)])
    for picture in (b"one picture", b"another one"):
        engine_uuid = fetched_image_uuid(image_uuid(url), hashlib.sha256(picture).hexdigest())
        stored = BlockStored(
            block_hashes=[1, 2, 3, 4],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=block,
            extra_keys=[None, [(engine_uuid, 4)], None, None],
        )
        assert stored_block_hashes(None, stored) == requested
    assert routing_image_uuid("not-a-fetched-uuid") == "not-a-fetched-uuid"
    assert routing_image_uuid(image_uuid(url)) == image_uuid(url)
