"""vLLM: declares no image token; its processor expands the checkpoint's own placeholder string."""

from __future__ import annotations

from pathlib import Path

from dynamo_prep.card import read_json
from dynamo_prep.formatter import DEFAULT_KIMI_IMAGE_PLACEHOLDER
from dynamo_prep.models import resolve_model_dir

__all__ = ["DEFAULT_KIMI_IMAGE_PLACEHOLDER", "checkpoint_image_placeholder", "declared_image_token"]

KIMI_K3_MODEL_TYPE = "kimi_k3"


def declared_image_token(engine: object | None) -> None:
    """Always None: vLLM's Kimi-K3 processor finds the checkpoint's ``image_placeholder`` string
    (several BPE ids, not a registered token) in the prompt and replaces each occurrence with the
    media block. The frontend renders exactly that default when a worker declares nothing, so any
    declaration here would break the contract.
    """
    del engine


def checkpoint_image_placeholder(model_dir: str | Path) -> str | None:
    """config.json ``image_placeholder``; for Kimi-K3 without one, ``<|kimi_image_placeholder|>``.

    None for other models: their chat template places the image tokens itself.
    """
    config = read_json(resolve_model_dir(model_dir) / "config.json")
    placeholder = config.get("image_placeholder")
    if isinstance(placeholder, str) and placeholder:
        return placeholder
    if config.get("model_type") == KIMI_K3_MODEL_TYPE:
        return DEFAULT_KIMI_IMAGE_PLACEHOLDER
    return None
