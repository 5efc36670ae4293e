"""vLLM's image contract: no declared token; its processor expands the checkpoint's placeholder.

vLLM's Kimi-K3 processor finds the checkpoint's ``image_placeholder`` string (several BPE ids, not
a registered token) in the prompt and replaces each occurrence with the media block. The frontend
renders exactly that default when a worker declares nothing, so a vLLM worker never declares.

The frontend encodes the placeholder as a segment of its own, so its stand-alone ids reach the
engine whole whatever text surrounds it (tests/test_k3_vllm_placeholder.py). Text a user types is
encoded with the same BPE, so a typed placeholder would count as an image: the worker counts the
runs and refuses a prompt whose count differs from its images, before vLLM sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dynamo_prep.card import ModelCardError, read_json
from dynamo_prep.engines.base import EngineContractError
from dynamo_prep.engines.bridge import EmulatedContract
from dynamo_prep.engines.mock.standins import QWEN_VL_MODEL_TYPES, QwenVLImageProcessorStandIn
from dynamo_prep.formatter import DEFAULT_IMAGE_PLACEHOLDER, checkpoint_image_placeholder, is_kimi_k3
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.protocol.kv_events import placeholder_starts
from dynamo_prep.tokenizer import Tokenizer

__all__ = [
    "QWEN_IMAGE_PAD",
    "check_placeholder_count",
    "emulated_contract",
    "expanded_image_placeholder",
    "placeholder_mismatch",
]

QWEN_IMAGE_PAD = "<|image_pad|>"


def placeholder_mismatch(spelling: str, pattern: Sequence[int], expected: int, found: int) -> str:
    """vLLM's complaint, worded once for the worker's check and the mock's."""
    return (
        f"Expected {expected} occurrence(s) of the image placeholder {spelling!r} "
        f"(token ids {list(pattern)}), one per image, found {found}"
    )


def check_placeholder_count(
    token_ids: Sequence[int], pattern: Sequence[int], spelling: str, images: int
) -> None:
    """One run of the placeholder's ids per image, or ``EngineContractError`` (a 400)."""
    found = len(placeholder_starts(token_ids, pattern))
    if found != images:
        raise EngineContractError(placeholder_mismatch(spelling, pattern, images, found))


def expanded_image_placeholder(model_dir: str | Path) -> str | None:
    """The string vLLM expands per image: the checkpoint's own, as the frontend renders it.

    None for a model whose chat template places its image tokens itself.
    """
    directory = resolve_model_dir(model_dir)
    config = read_json(directory / "config.json")
    placeholder = checkpoint_image_placeholder(config)
    model_type = config.get("model_type")
    if placeholder is None and is_kimi_k3(
        model_type if isinstance(model_type, str) else None, directory.resolve().name
    ):
        return DEFAULT_IMAGE_PLACEHOLDER  # K3 by its name alone: the formatter renders the default too
    return placeholder


def emulated_contract(model_dir: Path, tokenizer: Tokenizer) -> EmulatedContract:
    """vLLM finds the checkpoint placeholder's own id sequence (K3), or Qwen's ``<|image_pad|>``;
    a vLLM worker declares nothing."""
    placeholder = expanded_image_placeholder(model_dir)
    if placeholder is not None:
        ids = tuple(tokenizer.encode(placeholder, allow_special=False))
        return _contract(ids, ids, placeholder)
    if tokenizer.model_type not in QWEN_VL_MODEL_TYPES:
        return EmulatedContract(None, None, None, _no_mismatch, None)
    pad_id = tokenizer.token_to_id(QWEN_IMAGE_PAD)
    if pad_id is None:
        raise ModelCardError(f"{model_dir}: the tokenizer has no {QWEN_IMAGE_PAD} token")
    strip = tokenizer.encode(QwenVLImageProcessorStandIn.IMAGE_TOKEN, allow_special=True)
    return _contract((pad_id,), tuple(strip), QWEN_IMAGE_PAD)


def _contract(pattern: tuple[int, ...], strip: tuple[int, ...], spelling: str) -> EmulatedContract:
    def mismatch(expected: int, found: int) -> str:
        return placeholder_mismatch(spelling, pattern, expected, found)

    return EmulatedContract(pattern, strip, spelling, mismatch, None)


def _no_mismatch(expected: int, found: int) -> str:
    """Never asked: a model without a placeholder takes no images (the mock words that itself)."""
    return f"Expected {expected} image(s), found {found}"
