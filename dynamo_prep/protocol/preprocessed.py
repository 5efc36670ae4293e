"""The preprocessed request: what the frontend sends a worker instead of text."""

from __future__ import annotations

from typing import Any

import msgspec


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

    ``uuid`` is the image's identity, a content hash of its URL (a ``data:`` URL is the image
    itself): the frontend routes by it and hands it to the engine (vLLM's multimodal UUID), so
    the engine's KV-cache events name the same image.
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
