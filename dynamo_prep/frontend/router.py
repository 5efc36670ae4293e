"""Choose the instance first, then render for it: round robin plus one preprocessor per declaration.

A model's pool may mix engines that want different per-image tokens (SGLang declares
``<|media_pad|>``, vLLM declares nothing and expands the checkpoint's placeholder). A prompt is
only correct for the engine it goes to, so the router picks the instance before anything is
rendered and hands out the preprocessor built for that instance's declaration. Preprocessors are
cached per (model checksum, token) and share the model's tokenizer; only the formatter differs.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Set
from dataclasses import dataclass

import msgspec
import structlog

from dynamo_prep.discovery.catalog import LiveModel
from dynamo_prep.formatter import prompt_formatter_for
from dynamo_prep.frontend.metrics import FrontendMetrics
from dynamo_prep.preprocessor import OpenAIPreprocessor

__all__ = ["ANY_TOKEN", "Pick", "Router"]

log = structlog.get_logger("dynamo_prep.frontend")


class _Any(enum.Enum):
    TOKEN = "any"


ANY_TOKEN = _Any.TOKEN  # ``pick(image_token=...)`` default: any declaration will do


@dataclass(frozen=True, slots=True)
class Pick:
    """One routing decision: where the request goes and which token its prompt must carry."""

    instance_id: str
    endpoint: str
    image_token: str | None


class Router:
    """Round robin over a model's live instances; per-declaration preprocessors on demand."""

    def __init__(self, *, metrics: FrontendMetrics | None = None) -> None:
        # Counts per-declaration preprocessors built for an unregistered token (a private registry
        # when the frontend does not pass its own).
        self.metrics = metrics if metrics is not None else FrontendMetrics()
        self._turns: dict[str, itertools.count[int]] = {}
        self._preprocessors: dict[tuple[str, str | None], OpenAIPreprocessor] = {}

    def pick(
        self,
        model: LiveModel,
        *,
        excluded: Set[str] = frozenset(),
        image_token: str | _Any | None = ANY_TOKEN,
    ) -> Pick | None:
        """The next instance in turn whose endpoint is not ``excluded``.

        With ``image_token`` given, only instances with that declaration qualify (a request already
        rendered for one contract may only move to an instance with the same one).
        """
        candidates = [
            Pick(instance_id, endpoint, model.image_token_of(instance_id))
            for instance_id, endpoint in sorted(model.instances.items())
            if endpoint not in excluded
        ]
        if image_token is not ANY_TOKEN:
            candidates = [pick for pick in candidates if pick.image_token == image_token]
        if not candidates:
            return None
        turn = next(self._turns.setdefault(model.name, itertools.count()))
        return candidates[turn % len(candidates)]

    def preprocessor(self, model: LiveModel, image_token: str | None) -> OpenAIPreprocessor:
        """The preprocessor rendering ``image_token`` for ``model`` (built once, then cached).

        Building reads the formatter's files from the model directory (milliseconds); the
        canonical declaration needs no build at all.
        """
        canonical = model.preprocessor
        if image_token == canonical.card.runtime_config.image_placeholder_token:
            return canonical
        key = (model.mdcsum, image_token)
        cached = self._preprocessors.get(key)
        if cached is not None:
            return cached
        if model.model_dir is None:
            raise RuntimeError(f"model {model.name} has no model directory to build a formatter from")
        card = msgspec.structs.replace(
            model.card,
            runtime_config=msgspec.structs.replace(
                model.card.runtime_config, image_placeholder_token=image_token
            ),
        )
        formatter = prompt_formatter_for(card, model.model_dir, image_placeholder_token=image_token)
        built = OpenAIPreprocessor.new_with_parts(card, formatter, canonical.tokenizer)
        self._preprocessors[key] = built
        self.metrics.discovery.note_unregistered(built.unregistered_image_token)
        log.info(
            "declaration_preprocessor_built",
            model=model.name,
            image_placeholder_token=image_token,
            image_token=formatter.image_token,
            formatter=formatter.kind,
        )
        return built
