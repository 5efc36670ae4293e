"""vLLM: declares no image token; its processor expands the checkpoint's own placeholder string.

vLLM's Kimi-K3 processor finds the checkpoint's ``image_placeholder`` string (several BPE ids, not
a registered token) in the prompt and replaces each occurrence with the media block. The frontend
renders exactly that default when a worker declares nothing, so a vLLM worker never declares.
"""

from __future__ import annotations

from pathlib import Path

from dynamo_prep.card import read_json
from dynamo_prep.formatter import DEFAULT_IMAGE_PLACEHOLDER, checkpoint_image_placeholder, is_kimi_k3
from dynamo_prep.models import resolve_model_dir

__all__ = ["expanded_image_placeholder"]


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
