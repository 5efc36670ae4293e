"""The per-image token an engine of each flavor declares in its worker's card."""

from __future__ import annotations

from dynamo_prep.engines.base import FLAVORS, Flavor
from dynamo_prep.engines.sglang import declare as sglang

__all__ = ["declared_image_token"]


def declared_image_token(engine: object | None, flavor: Flavor) -> str | None:
    """SGLang: read from the processor ``engine`` loaded; vLLM: None (see ``engines.vllm``)."""
    if flavor == "sglang":
        return sglang.declared_image_token(engine)
    if flavor == "vllm":
        return None
    raise ValueError(f"unknown engine flavor {flavor!r} (known: {', '.join(FLAVORS)})")
