"""Build a model's preprocessor from its card: files, then formatter and tokenizer, then join.

Blocking (file fetches, tokenizer load), so the watcher runs it in a thread. The formatter and the
tokenizer are built separately and joined with ``OpenAIPreprocessor.new_with_parts``, exactly as
the reference frontend does, so the declared-token check in ``new_with_parts`` runs on this path.
Every failure is a ``ModelBuildError`` whose ``stage`` tells ops where to look.
``build_preprocessor`` is the one place a model's parts are built, for the frontend and for
``dynamo-prep render`` alike.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import zmq

from dynamo_prep.card import ModelDeploymentCard
from dynamo_prep.discovery.files import ModelFileStore
from dynamo_prep.formatter import prompt_formatter_for
from dynamo_prep.preprocessor import OpenAIPreprocessor
from dynamo_prep.tokenizer import Tokenizer

__all__ = ["BuiltModel", "ModelBuildError", "ModelBuilder", "PreprocessorBuilder", "build_preprocessor"]

BuildStage = Literal["files", "formatter", "tokenizer", "preprocessor"]
_T = TypeVar("_T")


class ModelBuildError(RuntimeError):
    """A model could not be built; ``stage`` is where (files, formatter, tokenizer, preprocessor)."""

    def __init__(self, stage: BuildStage, cause: BaseException) -> None:
        super().__init__(f"{stage}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


class BuiltModel(msgspec.Struct, frozen=True, gc=False):
    """A ready preprocessor and where its files live (to say what a legacy card renders).

    ``model_dir`` is a ``str``: a ``Path`` is two objects the GC walks, per model."""

    preprocessor: OpenAIPreprocessor
    model_dir: str

    @property
    def formatter_kind(self) -> str:
        return self.preprocessor.formatter.kind

    @property
    def declared_token(self) -> str | None:
        """What the model's first card declared (the canonical preprocessor renders for it)."""
        return self.preprocessor.card.runtime_config.image_placeholder_token

    @property
    def rendered_token(self) -> str | None:
        """What the canonical formatter writes per image (None: the template places images itself)."""
        return self.preprocessor.formatter.rendered_token

    def checkpoint_token(self) -> str | None:
        """What is rendered for an instance that declares nothing (a legacy card, a vLLM worker)."""
        if self.declared_token is None:
            return self.rendered_token
        card = self.preprocessor.card
        return prompt_formatter_for(card, self.model_dir, image_placeholder_token=None).rendered_token


ModelBuilder = Callable[[ModelDeploymentCard, str], BuiltModel]
"""(canonical card, endpoint of an announcing instance) -> BuiltModel; raises ModelBuildError."""


class PreprocessorBuilder:
    """The production ``ModelBuilder``: local dir, cache or fetch, then formatter + tokenizer."""

    def __init__(
        self,
        store: ModelFileStore,
        *,
        local_model_path: Path | None = None,
        context: zmq.Context[Any] | None = None,
        fetch_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.local_model_path = local_model_path
        self.context = context
        self.fetch_timeout_s = fetch_timeout_s
        # Models of the same files (names of one checkpoint, a flood of names) share one tokenizer:
        # its vocabulary, its bounded caches and its objects are paid once, not per name.
        self._tokenizers: weakref.WeakValueDictionary[tuple[tuple[str, str], ...], Tokenizer] = (
            weakref.WeakValueDictionary()
        )
        self._tokenizers_lock = threading.Lock()  # builds run on several threads

    def __call__(self, card: ModelDeploymentCard, endpoint: str) -> BuiltModel:
        model_dir = _stage(
            "files",
            lambda: self.store.model_dir_for(
                card,
                local_model_path=self.local_model_path,
                endpoint=endpoint,
                timeout_s=self.fetch_timeout_s,
                context=self.context,
            ),
        )
        preprocessor = build_preprocessor(card, model_dir, tokenizer=lambda: self._tokenizer(card, model_dir))
        return BuiltModel(preprocessor=preprocessor, model_dir=str(model_dir))

    def _tokenizer(self, card: ModelDeploymentCard, model_dir: Path) -> Tokenizer:
        """The live tokenizer of a model with the same files (``model_dir`` holds the card's files,
        checked), else a new one."""
        files = tuple(sorted((name, ref.sha256) for name, ref in card.files.items()))
        with self._tokenizers_lock:
            found = self._tokenizers.get(files)
        if found is not None:
            return found
        tokenizer = Tokenizer.from_model_dir(model_dir)
        with self._tokenizers_lock:
            return self._tokenizers.setdefault(files, tokenizer)


def build_preprocessor(
    card: ModelDeploymentCard,
    model_dir: Path,
    *,
    tokenizer: Callable[[], Tokenizer] | None = None,
    generation_prompt: Literal["reference", "hosted"] = "reference",
    strict_hf_tokenization: bool = False,
) -> OpenAIPreprocessor:
    """The card's formatter (for its declared token) and tokenizer from ``model_dir``, joined.

    ``tokenizer`` gives the tokenizer (a shared one), else it is loaded from ``model_dir``; the other
    options are ``prompt_formatter_for``'s. Raises ``ModelBuildError``.
    """
    token = card.runtime_config.image_placeholder_token
    formatter = _stage(
        "formatter",
        lambda: prompt_formatter_for(
            card,
            model_dir,
            image_placeholder_token=token,
            generation_prompt=generation_prompt,
            strict_hf_tokenization=strict_hf_tokenization,
        ),
    )
    tokens = _stage("tokenizer", tokenizer or (lambda: Tokenizer.from_model_dir(model_dir)))
    return _stage("preprocessor", lambda: OpenAIPreprocessor.new_with_parts(card, formatter, tokens))


def _stage(stage: BuildStage, step: Callable[[], _T]) -> _T:
    try:
        return step()
    except Exception as exc:  # any failure of a stage is reported, never raised raw into the loop
        raise ModelBuildError(stage, exc) from exc
