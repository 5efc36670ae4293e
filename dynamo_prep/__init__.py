"""dynamo_prep: a frontend preprocessor for multimodal LLM serving clusters."""

from dynamo_prep.card import (
    CardDecodeError,
    CardDecodeResult,
    FileRef,
    ModelCardError,
    ModelDeploymentCard,
    ModelRuntimeConfig,
    decode_card,
    encode_card,
)

__all__ = [
    "CardDecodeError",
    "CardDecodeResult",
    "FileRef",
    "ModelCardError",
    "ModelDeploymentCard",
    "ModelRuntimeConfig",
    "decode_card",
    "encode_card",
]
