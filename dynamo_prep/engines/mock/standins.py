"""STAND-INS shaped like SGLang's classes (attribute names and values), not SGLang itself.

Real SGLang needs a GPU, so tests and the mock engine use these: an ``EngineStandIn`` has SGLang's
``tokenizer_manager.mm_processor.mm_tokens`` path, and each processor stand-in carries the values
SGLang's processor for that model sets. ``sglang.declared_image_token`` reads them exactly as it
reads a real engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.formatter import is_kimi_k3
from dynamo_prep.models import resolve_model_dir

__all__ = [
    "QWEN_VL_MODEL_TYPES",
    "EngineStandIn",
    "ImageProcessorStandIn",
    "KimiK3ImageProcessorStandIn",
    "MultimodalSpecialTokens",
    "QwenVLImageProcessorStandIn",
    "TokenizerManagerStandIn",
    "sglang_engine_standin",
]

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass
class MultimodalSpecialTokens:
    """Stand-in for SGLang's ``MultimodalSpecialTokens`` (the image fields only)."""

    image_token: str | list[str] | None = None
    image_token_id: int | None = None
    image_token_regex: re.Pattern[str] | None = None


class ImageProcessorStandIn:
    """Stand-in for SGLang's ``BaseMultimodalProcessor``: what matters here is ``mm_tokens``."""

    def __init__(self, hf_config: dict[str, Any], mm_tokens: MultimodalSpecialTokens) -> None:
        self.hf_config = hf_config
        self.mm_tokens = mm_tokens


class KimiK3ImageProcessorStandIn(ImageProcessorStandIn):
    """Stand-in for SGLang's ``KimiK3ImageProcessor``: one ``<|media_pad|>`` per image."""

    IMAGE_TOKEN = "<|media_pad|>"

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__(
            hf_config,
            MultimodalSpecialTokens(
                image_token=self.IMAGE_TOKEN,
                image_token_id=_config_id(hf_config, "media_placeholder_token_id"),
                image_token_regex=re.compile(r"(?:<\|media_pad\|>)+"),
            ),
        )


class QwenVLImageProcessorStandIn(ImageProcessorStandIn):
    """Stand-in for SGLang's Qwen-VL processor: a multi-token spelling, counted by ``<|image_pad|>``."""

    IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__(
            hf_config,
            MultimodalSpecialTokens(
                image_token=self.IMAGE_TOKEN,
                image_token_id=_config_id(hf_config, "image_token_id"),
                image_token_regex=re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>"),
            ),
        )


@dataclass
class TokenizerManagerStandIn:
    """Stand-in for SGLang's ``TokenizerManager``; ``mm_processor`` is None for a text-only model."""

    mm_processor: ImageProcessorStandIn | None


@dataclass
class EngineStandIn:
    """Stand-in for ``sglang.Engine``: the path to the processor is ``tokenizer_manager.mm_processor``."""

    tokenizer_manager: TokenizerManagerStandIn | None


# SGLang's processors by config.json model_type, beyond Kimi-K3 (recognised by ``is_kimi_k3``).
_PROCESSORS: dict[str, Callable[[dict[str, Any]], ImageProcessorStandIn]] = {
    # SGLang registers its Kimi-K3 processor for Kimi-K2.5 checkpoints too (same media tokens).
    "kimi_k25": KimiK3ImageProcessorStandIn,
    **dict.fromkeys(QWEN_VL_MODEL_TYPES, QwenVLImageProcessorStandIn),
}


def sglang_engine_standin(model_dir: str | Path) -> EngineStandIn:
    """The engine SGLang would build for this model directory, as far as its image contract goes."""
    directory = resolve_model_dir(model_dir)
    config_path = directory / "config.json"
    config = read_json(config_path)
    model_type = config.get("model_type")
    model_type = model_type if isinstance(model_type, str) else None
    if is_kimi_k3(model_type, directory.resolve().name):
        make: Callable[[dict[str, Any]], ImageProcessorStandIn] | None = KimiK3ImageProcessorStandIn
    else:
        make = _PROCESSORS.get(model_type or "")
    try:
        processor = None if make is None else make(config)
    except ValueError as exc:
        raise ModelCardError(f"{config_path}: {exc}") from exc
    return EngineStandIn(tokenizer_manager=TokenizerManagerStandIn(mm_processor=processor))


def _config_id(hf_config: dict[str, Any], key: str) -> int:
    """SGLang reads these ids from the HF config and fails at start-up without them; so do we."""
    value = hf_config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a token id, got {value!r}")
    return value
