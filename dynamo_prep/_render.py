"""``dynamo-prep render``: one request through the same parts the frontend uses."""

from __future__ import annotations

from typing import Any

from dynamo_prep.card import ModelDeploymentCard, ModelRuntimeConfig, read_json
from dynamo_prep.formatter import prompt_formatter_for
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.tokenizer import Tokenizer


def render_request(
    request: Any,
    *,
    model_path: str,
    served_name: str | None,
    declared_token: str | None,
    hosted: bool,
    strict_hf_tokenization: bool = False,
) -> dict[str, Any]:
    """Segments, text and token ids of one chat request, as a JSON-ready dict."""
    model_dir = resolve_model_dir(model_path)
    card = ModelDeploymentCard.from_model_dir(
        model_dir,
        served_name=served_name,
        runtime_config=ModelRuntimeConfig(image_placeholder_token=declared_token),
    )
    config = read_json(model_dir / "config.json")
    formatter = prompt_formatter_for(
        card,
        model_dir,
        config=config,
        image_placeholder_token=declared_token,
        generation_prompt="hosted" if hosted else "reference",
        strict_hf_tokenization=strict_hf_tokenization,
    )
    tokenizer = Tokenizer.from_model_dir(model_dir, config=config)
    preprocessor = OpenAIPreprocessor.new_with_parts(card, formatter, tokenizer)
    prompt = preprocessor.tokenize(request)
    segments = prompt.rendered.segments
    return {
        "model": card.display_name,
        "formatter": formatter.kind,
        "declared_token": declared_token,
        "rendered_token": formatter.rendered_token,
        "segments": None if segments is None else [[s.text, s.allow_special] for s in segments],
        "text": prompt.rendered.text,
        "token_ids": prompt.token_ids,
        "num_tokens": len(prompt.token_ids),
        "images": [image.url for image in prompt.images],
    }
