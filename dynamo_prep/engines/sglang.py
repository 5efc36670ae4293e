"""SGLang: the per-image token a worker declares, read from the processor SGLang actually loaded.

SGLang's multimodal processor states its own prompt contract in ``mm_tokens.image_token`` (Kimi-K3:
one ``<|media_pad|>`` per image). Reading it from the loaded processor, instead of inferring it
from the model name, keeps the declaration true when SGLang's processors change. The reader
never raises: a worker that cannot tell declares nothing, and the frontend renders the
checkpoint default.

The classes below the reader are STAND-INS shaped exactly like SGLang's (attribute names and
values), not SGLang itself: real SGLang needs a GPU. Tests and the mock engine use them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.models import resolve_model_dir

__all__ = [
    "EngineStandIn",
    "ImageProcessorStandIn",
    "KimiK3ImageProcessorStandIn",
    "MultimodalSpecialTokens",
    "QwenVLImageProcessorStandIn",
    "TokenizerManagerStandIn",
    "declared_image_token",
    "sglang_engine_standin",
]

log = structlog.get_logger("dynamo_prep.engines")

KIMI_K3_MODEL_TYPES = frozenset({"kimi_k3", "kimi_k25"})
QWEN_VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
_ABSENT = object()
_MAX_LOGGED_CHARS = 200


def declared_image_token(engine: object | None) -> str | None:
    """``engine.tokenizer_manager.mm_processor.mm_tokens.image_token`` when it names one spelling.

    None (the checkpoint default is rendered) for: no engine or no tokenizer manager (e.g. an
    encode-only worker), a text-only model (``mm_processor is None``), a processor without
    ``mm_tokens`` (LLaVA-style), several distinct spellings (ambiguous: declined with a warning),
    or a value that is not a non-empty string.
    """
    if engine is None:
        _absent("no_engine")
        return None
    manager = _read(engine, "tokenizer_manager")
    if manager is None or manager is _ABSENT:
        _absent("no_tokenizer_manager")
        return None
    processor = _read(manager, "mm_processor")
    if processor is _ABSENT:
        _absent("no_mm_processor")
        return None
    if processor is None:
        _absent("text_only")
        return None
    processor_name = type(processor).__name__
    mm_tokens = _read(processor, "mm_tokens")
    if mm_tokens is None or mm_tokens is _ABSENT:
        log.info("declared_image_token_no_mm_tokens", processor=processor_name)
        return None
    image_token = _read(mm_tokens, "image_token")
    return _single_spelling(None if image_token is _ABSENT else image_token, processor_name)


def _read(obj: object, name: str) -> object:
    """``getattr`` that never raises: a half-built engine's properties may fail with anything."""
    try:
        return getattr(obj, name, _ABSENT)
    except Exception as exc:
        log.warning("declared_image_token_read_failed", attribute=name, error=repr(exc)[:_MAX_LOGGED_CHARS])
        return _ABSENT


def _absent(reason: str) -> None:
    log.debug("declared_image_token_absent", reason=reason)


def _single_spelling(value: object, processor: str) -> str | None:
    """SGLang's type hint allows a list of spellings; only one distinct spelling is a declaration."""
    token = value
    if isinstance(value, list | tuple) and value and all(isinstance(item, str) for item in value):
        spellings = list(dict.fromkeys(value))
        if len(spellings) > 1:
            log.warning("declared_image_token_declined", processor=processor, spellings=spellings)
            return None
        token = spellings[0]
    if isinstance(token, str) and token:
        log.debug("declared_image_token_read", processor=processor, token=token)
        return token
    log.warning(
        "declared_image_token_invalid",
        processor=processor,
        value_type=type(value).__name__,
        value=repr(value)[:_MAX_LOGGED_CHARS],
    )
    return None


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


def sglang_engine_standin(model_dir: str | Path) -> EngineStandIn:
    """The engine SGLang would build for this model directory, as far as its image contract goes."""
    config_path = resolve_model_dir(model_dir) / "config.json"
    config = read_json(config_path)
    model_type = config.get("model_type")
    processor: ImageProcessorStandIn | None = None
    try:
        if model_type in KIMI_K3_MODEL_TYPES:
            processor = KimiK3ImageProcessorStandIn(config)
        elif model_type in QWEN_VL_MODEL_TYPES:
            processor = QwenVLImageProcessorStandIn(config)
    except ValueError as exc:
        raise ModelCardError(f"{config_path}: {exc}") from exc
    return EngineStandIn(tokenizer_manager=TokenizerManagerStandIn(mm_processor=processor))


def _config_id(hf_config: dict[str, Any], key: str) -> int:
    """SGLang reads these ids from the HF config and fails at start-up without them; so do we."""
    value = hf_config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a token id, got {value!r}")
    return value
