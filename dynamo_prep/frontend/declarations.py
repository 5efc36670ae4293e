"""One preprocessor per declared token: what each engine of a mixed pool must receive.

A model's pool may mix engines that want different per-image tokens (SGLang declares
``<|media_pad|>``, vLLM declares nothing and expands the checkpoint's placeholder). The canonical
preprocessor (built from the model's first card) serves its own declaration; any other is built
once per (model checksum, declared token), sharing the model's tokenizer: only the formatter
differs, and only a Kimi-K3 formatter ever receives the token.
"""

from __future__ import annotations

import msgspec
import structlog

from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.discovery.metrics import DiscoveryMetrics
from dynamo_prep.formatter import prompt_formatter_for
from dynamo_prep.preprocessor import OpenAIPreprocessor

__all__ = ["DeclarationPreprocessors"]

log = structlog.get_logger("dynamo_prep.frontend")


class DeclarationPreprocessors:
    """``get`` answers from what is built (never blocks); ``build`` reads files (run it in a thread)."""

    def __init__(self, metrics: DiscoveryMetrics | None = None) -> None:
        # Counts preprocessors built for an unregistered token (a private registry by default).
        self.metrics = metrics if metrics is not None else DiscoveryMetrics()
        self._built: dict[tuple[str, str | None], OpenAIPreprocessor] = {}
        self._placeholders: dict[tuple[str, str | None], tuple[int, ...]] = {}

    def get(self, model: LiveModel, declared_token: str | None) -> OpenAIPreprocessor | None:
        """The preprocessor rendering for ``declared_token``, if it exists already."""
        canonical = model.preprocessor
        if declared_token == canonical.card.runtime_config.image_placeholder_token:
            return canonical
        return self._built.get((model.mdcsum, declared_token))

    def placeholder(self, model: LiveModel, declared_token: str | None) -> tuple[int, ...]:
        """The ids one image's placeholder takes in prompts rendered for ``declared_token`` (empty
        when the formatter writes no token of its own)."""
        key = (model.mdcsum, declared_token)
        ids = self._placeholders.get(key)
        if ids is None:
            preprocessor = self.get(model, declared_token) or model.preprocessor
            token = preprocessor.formatter.rendered_token
            ids = tuple(preprocessor.tokenizer.encode(token, allow_special=True)) if token else ()
            self._placeholders[key] = ids
        return ids

    def build(self, model: LiveModel, declared_token: str | None) -> OpenAIPreprocessor:
        """``get``, building (and keeping) the preprocessor first when needed."""
        existing = self.get(model, declared_token)
        if existing is not None:
            return existing
        if model.model_dir is None:
            raise RuntimeError(f"model {model.name} has no model directory to build a formatter from")
        runtime = msgspec.structs.replace(model.card.runtime_config, image_placeholder_token=declared_token)
        card = msgspec.structs.replace(model.card, runtime_config=runtime)
        formatter = prompt_formatter_for(card, model.model_dir, image_placeholder_token=declared_token)
        built = OpenAIPreprocessor.new_with_parts(card, formatter, model.preprocessor.tokenizer)
        self._built[(model.mdcsum, declared_token)] = built
        self.metrics.note_unregistered(built.unregistered_image_token)
        log.info(
            "declaration_preprocessor_built",
            model=model.name,
            declared_token=declared_token,
            rendered_token=formatter.rendered_token,
            formatter=formatter.kind,
        )
        return built
