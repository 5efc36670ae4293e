"""``dynamo-prep render``: one request through the same parts the frontend uses, without a network.

The card comes from a local model directory (a worker's declared token in its runtime config); its
preprocessor is built by ``discovery.builder.build_preprocessor``, the code that builds every
model the frontend serves, so the ids printed are the ids the frontend would send.
"""

from __future__ import annotations

from typing import Any

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig
from dynamo_prep.discovery.builder import ModelBuildError, build_preprocessor
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor

__all__ = ["render_request"]


def render_request(
    request: Any,
    *,
    model_path: str,
    served_name: str | None,
    declared_token: str | None,
    hosted: bool,
    strict_hf_tokenization: bool = False,
) -> dict[str, Any]:
    """Segments, text and token ids of one chat request, as a JSON-ready dict.

    Raises what the failing part raised (``ModelCardError``, ``TokenizerError``,
    ``PreprocessError``, ...: a ``ValueError`` or an ``OSError``)."""
    preprocessor = _preprocessor(model_path, served_name, declared_token, hosted, strict_hf_tokenization)
    formatter = preprocessor.formatter
    prompt = preprocessor.tokenize(request)
    segments = prompt.rendered.segments
    return {
        "model": preprocessor.card.display_name,
        "formatter": formatter.kind,
        "declared_token": declared_token,
        "rendered_token": formatter.rendered_token,
        "segments": None if segments is None else [[s.text, s.allow_special] for s in segments],
        "text": prompt.rendered.text,
        "token_ids": prompt.token_ids,
        "num_tokens": len(prompt.token_ids),
        "images": [image.url for image in prompt.images],
    }


def _preprocessor(
    model_path: str, served_name: str | None, declared_token: str | None, hosted: bool, strict_hf: bool
) -> OpenAIPreprocessor:
    model_dir = resolve_model_dir(model_path)
    card = ModelDeploymentCard.from_model_dir(
        model_dir,
        served_name=served_name,
        runtime_config=ModelRuntimeConfig(image_placeholder_token=declared_token),
    )
    try:
        return build_preprocessor(
            card,
            model_dir,
            generation_prompt="hosted" if hosted else "reference",
            strict_hf_tokenization=strict_hf,
        )
    except ModelBuildError as exc:
        raise exc.cause from None  # the part's own error, as the CLI reports it
