"""Which tokenizer a model directory holds, loaded: ``tokenizer.json`` or tiktoken ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynamo_prep.card import HF_TOKENIZER_FILE, ModelCardError, model_files, read_json, read_optional_json
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.tokenizer._base import Tokenizer, TokenizerError
from dynamo_prep.tokenizer._hf import HfTokenizer
from dynamo_prep.tokenizer._tiktoken import TiktokenTokenizer

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str | Path, *, config: dict[str, Any] | None = None) -> Tokenizer:
    """The directory's tokenizer; a bad layout or file is a ``TokenizerError`` naming the file."""
    model_dir = resolve_model_dir(path)
    try:
        files = model_files(model_dir)
        if config is None:
            config = read_json(files["config.json"])
        tokenizer_config = read_optional_json(files, "tokenizer_config.json")
        generation_config = read_optional_json(files, "generation_config.json")
        if HF_TOKENIZER_FILE in files:
            special_tokens_map = read_optional_json(files, "special_tokens_map.json")
            return HfTokenizer.load(
                model_dir, files, config, {**special_tokens_map, **tokenizer_config}, generation_config
            )
    except ModelCardError as exc:
        raise TokenizerError(str(exc)) from exc
    return TiktokenTokenizer.load(model_dir, files, config, tokenizer_config, generation_config)
