"""Prompt formatters: a chat request in, a rendered (and possibly segmented) prompt out.

Kimi-K3 has a native formatter; every other family renders its Jinja chat template. The worker's
declared per-image token reaches ONLY the Kimi-K3 formatter: no Jinja family has a parameter that
could receive it, so a Qwen-VL prompt is byte-identical whatever a worker declares.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Protocol

from dynamo_prep.card import ModelDeploymentCard, read_json
from dynamo_prep.formatter._prompt import PromptRenderError, RenderedPrompt, Segment
from dynamo_prep.formatter.jinja import JinjaFormatter
from dynamo_prep.formatter.kimi_k3 import KimiK3Formatter
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.openai import ChatCompletionRequest

__all__ = [
    "JinjaFormatter",
    "KimiK3Formatter",
    "PromptFormatter",
    "PromptRenderError",
    "RenderedPrompt",
    "Segment",
    "kimi_k3_formatter_for",
    "prompt_formatter_for",
]

DEFAULT_KIMI_IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
_KIMI_K3_NAME_MARKERS = ("kimi-k3", "kimi_k3", "kimik3")


class PromptFormatter(Protocol):
    """What the preprocessor needs from a formatter."""

    @property
    def kind(self) -> str: ...

    @property
    def image_token(self) -> str | None: ...

    def render(self, request: ChatCompletionRequest) -> RenderedPrompt: ...

    def with_tokenizer_specials(self, specials: Iterable[str]) -> PromptFormatter:
        """The formatter as joined with a tokenizer that registers ``specials``."""
        ...


def is_kimi_k3(model_type: str | None, display_name: str) -> bool:
    """config.json ``model_type == "kimi_k3"``; only without a model_type, the served name decides."""
    if model_type is not None:
        return model_type == "kimi_k3"
    name = display_name.lower()
    return any(marker in name for marker in _KIMI_K3_NAME_MARKERS)


def kimi_k3_formatter_for(
    model_type: str | None,
    display_name: str,
    exclude_tools_when_tool_choice_none: bool,
    image_placeholder_token: str | None,
    *,
    default_image_placeholder: str = DEFAULT_KIMI_IMAGE_PLACEHOLDER,
    generation_prompt: Literal["reference", "hosted"] = "reference",
) -> KimiK3Formatter | None:
    """The Kimi-K3 formatter for a K3 model, else None.

    ``exclude_tools_when_tool_choice_none`` is accepted for every family but not applied to K3:
    the K3 contract keeps the tool declarations under ``tool_choice=none`` (hosted groundtruth
    counts them).
    """
    del exclude_tools_when_tool_choice_none
    if not is_kimi_k3(model_type, display_name):
        return None
    return KimiK3Formatter(
        image_placeholder_token,
        default_image_placeholder=default_image_placeholder,
        generation_prompt=generation_prompt,
    )


def prompt_formatter_for(
    card: ModelDeploymentCard,
    model_dir: str | Path,
    *,
    image_placeholder_token: str | None = None,
    generation_prompt: Literal["reference", "hosted"] = "reference",
    strict_hf_tokenization: bool = False,
) -> PromptFormatter:
    """Kimi-K3 first, else the model's Jinja chat template.

    ``strict_hf_tokenization`` (Jinja only) encodes the rendered text whole, as Hugging Face does,
    so user text that spells a special token becomes that token; the default keeps user text text.
    """
    directory = resolve_model_dir(model_dir)
    exclude_tools = card.runtime_config.exclude_tools_when_tool_choice_none
    config = read_json(directory / "config.json")
    default_placeholder = config.get("image_placeholder")
    kimi = kimi_k3_formatter_for(
        card.model_type,
        card.display_name,
        exclude_tools,
        image_placeholder_token,
        default_image_placeholder=(
            default_placeholder if isinstance(default_placeholder, str) else DEFAULT_KIMI_IMAGE_PLACEHOLDER
        ),
        generation_prompt=generation_prompt,
    )
    if kimi is not None:
        return kimi
    return JinjaFormatter.from_model_dir(
        directory,
        exclude_tools_when_tool_choice_none=exclude_tools,
        strict_hf_tokenization=strict_hf_tokenization,
    )
