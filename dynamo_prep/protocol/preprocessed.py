"""The preprocessed request: what the frontend sends a worker instead of text."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Final

import msgspec

# An image's identity as the engine gets it for a fetched http(s) image: the frontend's uuid (of the
# URL), a dash, and the digest of the bytes fetched (docs/engines.md, "Images and their identity").
_FETCHED_UUID: Final = re.compile(r"[0-9a-f]{32}-[0-9a-f]{32}")
_UUID_CHARS: Final = 32


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """When generation ends. ``stop_token_ids_hidden`` are the model's EOS ids (not echoed).

    ``stop`` (stop strings) is Dynamo's field; this frontend leaves it empty and applies the
    client's stop strings to the answer's content itself, cancelling the generation at a match.
    """

    max_tokens: int
    min_tokens: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    stop_token_ids_hidden: list[int] = []
    ignore_eos: bool = False


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """Constrained decoding the engine applies (exactly one kind is set; docs/structured-outputs.md).

    ``json_schema``: the output is an instance of this JSON schema (its JSON text, as the client
    sent it in ``response_format`` or built from a forced tool choice); ``json_object``: the output
    is a JSON object.
    """

    json_schema: str | None = None
    json_object: bool = False


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling knobs as the client sent them; None means the engine default. ``structured``: the
    constraint on the output (None: free text)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    structured: StructuredOutput | None = None


class OutputOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    logprobs: bool = False
    top_logprobs: int | None = None


class ImageRef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image of the request, in prompt order: an http(s) URL or a ``data:`` URL.

    ``uuid`` is the frontend's identity of the image, the hash of its URL (``image_uuid``): the KV
    router names the image by it. The worker hands the engine an identity of what it fetched
    (``fetched_image_uuid``), which the router reads back with ``routing_image_uuid``.
    """

    url: str
    detail: str | None = None
    uuid: str = ""


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Token ids plus everything an engine needs to generate; MessagePack on the request plane."""

    model: str
    token_ids: list[int]
    stop_conditions: StopConditions
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = []
    images: list[ImageRef] = []
    mdcsum: str = ""
    annotations: dict[str, Any] = {}


def image_uuid(url: str) -> str:
    """The frontend's identity of an image: the first 128 bits of the sha256 of its URL, in hex.

    For a ``data:`` URL that is the image's own bytes, and the engine gets it as is."""
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:_UUID_CHARS]


def fetched_image_uuid(url_uuid: str, digest: str) -> str:
    """The engine's identity of an http(s) image: its URL's uuid and the sha256 ``digest`` (hex) of
    the bytes fetched, so another image at the same URL is another image to the engine's caches."""
    return f"{url_uuid}-{digest[:_UUID_CHARS]}"


def routing_image_uuid(identifier: str) -> str:
    """The part of an engine's image identity the router knows before any fetch: a fetched image's
    URL uuid; any other identifier unchanged."""
    return identifier[:_UUID_CHARS] if _FETCHED_UUID.fullmatch(identifier) else identifier
