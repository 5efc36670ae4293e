"""vLLM: declares no image token; its processor expands the checkpoint's own placeholder string.

vLLM's Kimi-K3 processor finds the checkpoint's ``image_placeholder`` string (several BPE ids, not
a registered token) in the prompt and replaces each occurrence with the media block. The frontend
renders exactly that default when a worker declares nothing, so a vLLM worker never declares.
"""

from __future__ import annotations

from pathlib import Path

from dynamo_prep.card import read_json
from dynamo_prep.formatter import DEFAULT_KIMI_IMAGE_PLACEHOLDER, is_kimi_k3
from dynamo_prep.models import resolve_model_dir

__all__ = ["checkpoint_image_placeholder"]


def checkpoint_image_placeholder(model_dir: str | Path) -> str | None:
    """config.json ``image_placeholder``; for Kimi-K3 without one, ``<|kimi_image_placeholder|>``.

    None for other models: their chat template places the image tokens itself.
    """
    directory = resolve_model_dir(model_dir)
    config = read_json(directory / "config.json")
    placeholder = config.get("image_placeholder")
    if isinstance(placeholder, str) and placeholder:
        return placeholder
    model_type = config.get("model_type")
    if is_kimi_k3(model_type if isinstance(model_type, str) else None, directory.resolve().name):
        return DEFAULT_KIMI_IMAGE_PLACEHOLDER
    return None
