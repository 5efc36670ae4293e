"""Prompt formatters: a chat request in, a rendered (and possibly segmented) prompt out.

Kimi-K3 has a native formatter; every other family renders its Jinja chat template. The worker's
declared per-image token reaches ONLY the Kimi-K3 formatter: no Jinja family has a parameter that
could receive it, so a Qwen-VL prompt is byte-identical whatever a worker declares.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Protocol

from dynamo_prep.card import ModelDeploymentCard, read_json
from dynamo_prep.formatter.jinja import JinjaFormatter
from dynamo_prep.formatter.kimi_k3 import (
    DEFAULT_IMAGE_PLACEHOLDER,
    KimiK3Formatter,
    checkpoint_image_placeholder,
    is_kimi_k3,
)
from dynamo_prep.formatter.parts import IMAGE_PART_TYPES, TEXT_PART_TYPES, collect_images
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.prompt import Piece, PromptRenderError, RenderedPrompt, Run, Segment
from dynamo_prep.protocol.openai import ChatCompletionRequest

__all__ = [
    "DEFAULT_IMAGE_PLACEHOLDER",
    "IMAGE_PART_TYPES",
    "TEXT_PART_TYPES",
    "JinjaFormatter",
    "KimiK3Formatter",
    "Piece",
    "PromptFormatter",
    "PromptRenderError",
    "RenderedPrompt",
    "Run",
    "Segment",
    "checkpoint_image_placeholder",
    "collect_images",
    "is_kimi_k3",
    "kimi_k3_formatter_for",
    "prompt_formatter_for",
]


class PromptFormatter(Protocol):
    """What the preprocessor needs from a formatter."""

    @property
    def kind(self) -> str: ...

    @property
    def rendered_token(self) -> str | None:
        """What the formatter writes per image (the declared token, the checkpoint default, or the
        template's own); None when the template places images itself."""
        ...

    def render(self, request: ChatCompletionRequest) -> RenderedPrompt: ...

    def with_tokenizer_specials(self, specials: Iterable[str]) -> PromptFormatter:
        """The formatter as joined with a tokenizer that registers ``specials``."""
        ...


def kimi_k3_formatter_for(
    model_type: str | None,
    display_name: str,
    image_placeholder_token: str | None,
    *,
    default_image_placeholder: str = DEFAULT_IMAGE_PLACEHOLDER,
    generation_prompt: Literal["reference", "hosted"] = "reference",
) -> KimiK3Formatter | None:
    """The Kimi-K3 formatter for a K3 model, else None.

    A card's ``exclude_tools_when_tool_choice_none`` does not apply to K3: the K3 contract keeps the
    tool declarations under ``tool_choice=none`` (hosted groundtruth counts them).
    """
    if not is_kimi_k3(model_type, display_name):
        return None
    return _kimi_k3_formatter(image_placeholder_token, default_image_placeholder, generation_prompt)


@functools.lru_cache(maxsize=64)
def _kimi_k3_formatter(
    image_placeholder_token: str | None,
    default_image_placeholder: str,
    generation_prompt: Literal["reference", "hosted"],
) -> KimiK3Formatter:
    """One formatter per contract (it holds nothing else): models of the same declaration share it."""
    return KimiK3Formatter(
        image_placeholder_token,
        default_image_placeholder=default_image_placeholder,
        generation_prompt=generation_prompt,
    )


def prompt_formatter_for(
    card: ModelDeploymentCard,
    model_dir: str | Path,
    *,
    config: dict[str, Any] | None = None,
    image_placeholder_token: str | None = None,
    generation_prompt: Literal["reference", "hosted"] = "reference",
    strict_hf_tokenization: bool = False,
) -> PromptFormatter:
    """Kimi-K3 first, else the model's Jinja chat template.

    ``config`` is the parsed ``config.json`` when the caller has already read it (it is read once
    per build either way). ``strict_hf_tokenization`` (Jinja only) encodes the rendered text whole,
    as Hugging Face does, so user text that spells a special token becomes that token; the default
    keeps user text text.
    """
    directory = resolve_model_dir(model_dir)
    if config is None:
        config = read_json(directory / "config.json")
    kimi = kimi_k3_formatter_for(
        card.model_type,
        card.display_name,
        image_placeholder_token,
        # a model that is K3 by its served name alone still gets the K3 default
        default_image_placeholder=checkpoint_image_placeholder(config) or DEFAULT_IMAGE_PLACEHOLDER,
        generation_prompt=generation_prompt,
    )
    if kimi is not None:
        return kimi
    return JinjaFormatter.from_model_dir(
        directory,
        config=config,
        exclude_tools_when_tool_choice_none=card.runtime_config.exclude_tools_when_tool_choice_none,
        strict_hf_tokenization=strict_hf_tokenization,
    )
