"""Many images in one request (issue 20, row 6): a cap with a 400 naming it, and a routing decision
linear in the request's size.

The cap is checked through a real ``dynamo-prep frontend --router-mode kv`` with a real mock worker:
one image over it is a 400 (``param: "messages"``, the limit in the message), the limit itself is
routed to the worker, whose image fetcher has a lower cap of its own (``ImageLimits.max_images``).
Linearity is an operation count: the spans of a prompt's images are handed to the hashing as a
sequence that counts every span read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import httpx
import pytest
from support.images import png_data_url
from support.plane import DynamoProcess, free_port, start_dynamo, tcp_endpoint, wait_for

from dynamo_prep.engines.images import DEFAULT_LIMITS
from dynamo_prep.preprocessor import MAX_IMAGES_PER_REQUEST
from dynamo_prep.protocol.kv_events import ImageSpan, image_spans, mm_extra_keys
from dynamo_prep.routing.hashing import ROOT_HASH, extra_key_id, request_block_hashes

K3 = "kimi-k3-demo"
BLOCK = 16
PLACEHOLDER = 9


def image(index: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_data_url((index % 256, 0, 0))}}


def chat(images: int) -> dict[str, Any]:
    content = [image(index) for index in range(images)] + [{"type": "text", "text": "Which is a cat?"}]
    return {"model": K3, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


@pytest.fixture
def frontend(tmp_path: Path, procs: list[DynamoProcess]) -> Iterator[str]:
    """A kv-mode frontend with one mock K3 worker admitted; its base URL."""
    discovery, port = tcp_endpoint(), free_port()
    front = start_dynamo(
        "frontend", "--discovery-bind", discovery, "--http-host", "127.0.0.1", "--http-port", str(port),
        "--router-mode", "kv", "--cache-dir", str(tmp_path / "cache"), log_level="info",
    )  # fmt: skip
    procs.append(front)
    front.wait_event("frontend_started", timeout=20)
    procs.append(start_dynamo("worker", "--model-path", K3, "--discovery", discovery, "--token-delay", "0"))
    wait_for(lambda: front.find("model_added"), 20, message="model_added")
    yield f"http://127.0.0.1:{port}"


def test_one_image_over_the_cap_is_a_400_naming_it_and_the_cap_is_routed(frontend: str) -> None:
    worker_cap = DEFAULT_LIMITS.max_images
    with httpx.Client(trust_env=False, timeout=60) as http:
        refused = http.post(f"{frontend}/v1/chat/completions", json=chat(MAX_IMAGES_PER_REQUEST + 1))
        routed = http.post(f"{frontend}/v1/chat/completions", json=chat(MAX_IMAGES_PER_REQUEST))
        served = http.post(f"{frontend}/v1/chat/completions", json=chat(worker_cap))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages"
    assert str(MAX_IMAGES_PER_REQUEST) in error["message"]
    assert str(MAX_IMAGES_PER_REQUEST + 1) in error["message"]
    # the worker's fetcher refuses more than its own cap before fetching any
    assert routed.status_code == 400, routed.text
    assert routed.json()["error"]["message"] == (
        "the engine refused the request: "
        f"too many images: {MAX_IMAGES_PER_REQUEST} in one request, the limit is {worker_cap}"
    )
    assert served.status_code == 200, served.text


class CountingSpans(Sequence[ImageSpan]):
    """A prompt's image spans that count every span read (one per item, a slice's length)."""

    def __init__(self, spans: list[ImageSpan]) -> None:
        self._spans = spans
        self.reads = 0

    def __len__(self) -> int:
        return len(self._spans)

    @overload
    def __getitem__(self, index: int) -> ImageSpan: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ImageSpan]: ...

    def __getitem__(self, index: int | slice) -> ImageSpan | Sequence[ImageSpan]:
        if isinstance(index, slice):
            items = self._spans[index]
            self.reads += len(items)
            return items
        self.reads += 1
        return self._spans[index]


def prompt(images: int, spacing: int) -> tuple[list[int], list[ImageSpan]]:
    """A prompt with an image placeholder every ``spacing`` ids (several images per block)."""
    token_ids = ([1] * (spacing - 1) + [PLACEHOLDER]) * images
    return token_ids, image_spans(token_ids, [PLACEHOLDER], [f"image-{index}" for index in range(images)])


@pytest.mark.parametrize(("images", "spacing"), [(500, 4), (4_000, 4), (4_000, 40), (2_000, 1)])
def test_routing_hashes_read_each_image_a_bounded_number_of_times(images: int, spacing: int) -> None:
    token_ids, spans = prompt(images, spacing)
    counting = CountingSpans(spans)
    hashes = request_block_hashes(token_ids, BLOCK, counting)
    assert hashes == request_block_hashes(token_ids, BLOCK, spans)
    blocks = len(token_ids) // BLOCK
    # Each image is read when it is walked, ordered, and enters and leaves the window of the blocks
    # it overlaps; testing every image for every block (the old way) is images x blocks reads.
    assert counting.reads <= 8 * (images + blocks), f"{counting.reads} span reads"


def reference_hashes(token_ids: list[int], spans: Sequence[ImageSpan]) -> list[int]:
    """The module's documented rule, block by block, testing every image for every block."""
    hashes, parent = [], ROOT_HASH
    for index in range(len(token_ids) // BLOCK):
        block = hash(tuple(token_ids[index * BLOCK : (index + 1) * BLOCK]))
        extra = extra_key_id(mm_extra_keys(spans, index * BLOCK, BLOCK))
        parent = hash((parent, block)) if extra is None else hash((parent, block, extra))
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("spacing", [1, 4, 16, 40])
def test_the_sweep_gives_the_rule_s_hashes_in_order_and_out_of_it(spacing: int) -> None:
    token_ids, spans = prompt(64, spacing)
    long_ones = [ImageSpan(span.identifier, span.start, spacing) for span in spans[:-1]]  # whole gaps
    for case in (spans, spans[::2] + spans[1::2], long_ones, long_ones[::-1]):
        assert request_block_hashes(token_ids, BLOCK, case) == reference_hashes(token_ids, case)
