"""SGLang's image contract as the mock enforces it: one processor ``image_token_id`` per image.

The mock reads it from a stand-in of the processor SGLang would load (``mock.standins``), the
same path ``declare`` reads on a real engine.
"""

from __future__ import annotations

from pathlib import Path

from dynamo_prep.engines.bridge import EmulatedContract
from dynamo_prep.engines.mock.standins import sglang_engine_standin
from dynamo_prep.engines.sglang.declare import declared_image_token
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["emulated_contract", "placeholder_mismatch"]


def placeholder_mismatch(expected: int, found: int) -> str:
    """SGLang's complaint."""
    return f"Expected {expected} image placeholder token(s), found {found}"


def emulated_contract(model_dir: Path, tokenizer: Tokenizer) -> EmulatedContract:
    """SGLang counts its processor's ``image_token_id``: one id per image."""
    engine = sglang_engine_standin(model_dir)
    declared = declared_image_token(engine)
    manager = engine.tokenizer_manager
    processor = manager.mm_processor if manager else None
    if processor is None or processor.mm_tokens.image_token_id is None:
        return EmulatedContract(None, None, None, placeholder_mismatch, declared)
    token_id = processor.mm_tokens.image_token_id
    spelling = processor.mm_tokens.image_token
    strip = (
        tuple(tokenizer.encode(spelling, allow_special=True)) if isinstance(spelling, str) else (token_id,)
    )
    return EmulatedContract(
        (token_id,), strip, tokenizer.id_to_token(token_id), placeholder_mismatch, declared
    )
