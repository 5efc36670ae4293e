"""The one interface every tokenizer kind implements, and what the kinds share (stop ids, range checks)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import structlog

from dynamo_prep.card import ModelCardError, model_files, read_json, read_optional_json
from dynamo_prep.models import resolve_model_dir
from dynamo_prep.prompt import Run

__all__ = ["Tokenizer", "TokenizerError", "TokenizerSource", "token_content"]

log = structlog.get_logger()


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or used; the message names the file and the field."""


class TokenizerSource(NamedTuple):
    """What a model directory tells a tokenizer: its files (paths by logical name) and the JSON
    of the ones every kind reads (empty where the directory has none)."""

    model_dir: Path
    files: Mapping[str, Path]
    config: dict[str, Any]
    tokenizer_config: dict[str, Any]  # special_tokens_map.json under tokenizer_config.json
    generation_config: dict[str, Any]


class Tokenizer(ABC):
    """One model's vocabulary, whatever file it comes from.

    ``special_tokens`` are the control tokens: one id where a formatter writes them (a control
    segment), plain text where a user typed them. ``added_tokens`` are every string that is one id
    (the control tokens and, for Hugging Face vocabularies, the non-special added tokens, which are
    one id wherever they appear). ``all_special_ids`` are what ``skip_special_tokens`` drops.
    """

    # Each kind names the file it reads (its logical name on the card) and registers itself by it.
    source_file: ClassVar[str]
    _kinds: ClassVar[dict[str, type[Tokenizer]]] = {}
    name: str
    model_type: str | None
    kind: str
    n_vocab: int
    special_tokens: Mapping[str, int]
    added_tokens: Mapping[str, int]
    all_special_ids: frozenset[int]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    context_length: int | None = None  # the tokenizer's own model_max_length, when it states one

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "source_file" in cls.__dict__:
            Tokenizer._kinds[cls.source_file] = cls

    @classmethod
    def from_model_dir(cls, path: str | Path, *, config: dict[str, Any] | None = None) -> Tokenizer:
        """The tokenizer a model directory (or demo model name) holds, by its file (``tokenizer.json``:
        Hugging Face ``tokenizers``; tiktoken ranks: Kimi). ``config`` is the parsed ``config.json``
        when the caller has already read it. A bad layout or file raises ``TokenizerError`` naming
        the file."""
        started = time.perf_counter()
        model_dir = resolve_model_dir(path)
        try:
            files = model_files(model_dir)
            source = TokenizerSource(
                model_dir,
                files,
                read_json(files["config.json"]) if config is None else config,
                {
                    **read_optional_json(files, "special_tokens_map.json"),
                    **read_optional_json(files, "tokenizer_config.json"),
                },
                read_optional_json(files, "generation_config.json"),
            )
        except ModelCardError as exc:
            raise TokenizerError(str(exc)) from exc
        kind = next(kind for name, kind in Tokenizer._kinds.items() if name in files)
        tokenizer = kind.load(source)
        tokenizer._set_stop_ids(source)
        log.debug(
            "tokenizer_loaded",
            model_dir=str(model_dir),
            kind=tokenizer.kind,
            model_type=tokenizer.model_type,
            n_vocab=tokenizer.n_vocab,
            load_ms=round((time.perf_counter() - started) * 1000, 1),
            **tokenizer.load_facts(),
        )
        return tokenizer

    @classmethod
    @abstractmethod
    def load(cls, source: TokenizerSource) -> Tokenizer:
        """This kind's tokenizer from the directory's files (stop ids are set by the caller)."""

    def load_facts(self) -> dict[str, Any]:
        """What this kind's load is worth logging beside the common fields."""
        return {}

    # -- encoding -----------------------------------------------------------------------------

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of ``text`` alone; control-token text is plain text unless ``allow_special``. No BOS/EOS."""

    @abstractmethod
    def encode_pieces(self, pieces: Iterable[tuple[str, bool] | Run]) -> list[int]:
        """A rendered prompt's ids: control segments may be control tokens, text segments never."""

    def encode_segments(self, segments: Iterable[tuple[str, bool]]) -> list[int]:
        """``encode_pieces`` of ``(text, allow_special)`` segments."""
        return self.encode_pieces(segments)

    @abstractmethod
    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """A raw prompt as the model's own tokenizer encodes it (``/tokenize``, completions)."""

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with what the tokenizer adds around a sequence (a BOS), as ``add_special_tokens``."""
        return list(ids)

    # -- decoding -----------------------------------------------------------------------------

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` as the model's own tokenizer decodes it; an unknown id raises."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id contributes to streamed text (empty outside the vocabulary)."""

    @abstractmethod
    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes ``ids`` contribute to streamed text: ``token_bytes`` of each, joined."""

    @property
    @abstractmethod
    def longest_token_bytes(self) -> int:
        """The bytes of the vocabulary's longest token (specials spelled out)."""

    @abstractmethod
    def token_to_id(self, text: str) -> int | None:
        """The id of a string that is exactly one token, or None."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """An added token's text or a vocabulary token's text; None when out of range."""

    # -- shared -------------------------------------------------------------------------------

    def is_special_token(self, text: str) -> bool:
        """Whether ``text`` is a registered token string that is always one id (never shattered)."""
        return text in self.added_tokens

    def is_registered(self, text: str) -> bool:
        """Whether ``text`` is one or more registered tokens back to back (e.g. SGLang's Qwen-VL
        ``<|vision_start|><|image_pad|><|vision_end|>``): no part of it is shattered into BPE pieces."""
        if text in self.added_tokens:
            return True
        ids = self.encode(text, allow_special=True)
        registered = set(self.added_tokens.values())
        return bool(ids) and all(token_id in registered for token_id in ids)

    def first_unknown_id(self, ids: Sequence[int]) -> int | None:
        """The first of ``ids`` outside the vocabulary ``[0, n_vocab)``, or None when all are in it."""
        if not ids or (min(ids) >= 0 and max(ids) < self.n_vocab):
            return None
        return next(token_id for token_id in ids if not 0 <= token_id < self.n_vocab)

    def unknown_id_error(self, ids: Sequence[int]) -> str | None:
        """What is wrong with ``ids`` for this vocabulary, worded for a client, or None."""
        bad, size = self.first_unknown_id(ids), self.n_vocab
        if bad is None:
            return None
        return f"token id {bad} is outside the vocabulary of {size} ids (0 to {size - 1})"

    def _set_stop_ids(self, source: TokenizerSource) -> None:
        """``bos_token_id`` and every stop id: generation_config, then config.json, then the tokenizer's
        own ``eos_token`` (tokenizer_config.json, else special_tokens_map.json)."""
        config, tokenizer_config, files = source.config, source.tokenizer_config, source.files
        tc_path = files.get("tokenizer_config.json", Path("tokenizer_config.json"))
        if (name := token_content(tokenizer_config.get("bos_token"))) is not None:
            self.bos_token_id = self._resolve(name, tc_path, "bos_token")
        elif "bos_token" not in tokenizer_config:
            self.bos_token_id = self._checked_id(
                config.get("bos_token_id"), files.get("config.json", Path("config.json")), "bos_token_id"
            )
        ids: list[int] = []
        for origin, name in ((source.generation_config, "generation_config.json"), (config, "config.json")):
            value = origin.get("eos_token_id")
            for item in value if isinstance(value, list) else [value]:
                token_id = self._checked_id(item, files.get(name, Path(name)), "eos_token_id")
                if token_id is not None:
                    ids.append(token_id)
        if (eos_name := token_content(tokenizer_config.get("eos_token"))) is not None:
            ids.append(self._resolve(eos_name, tc_path, "eos_token"))
        self.eos_token_ids = tuple(dict.fromkeys(ids))

    def _checked_id(self, value: object, path: Path, key: str) -> int | None:
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.n_vocab:
            raise TokenizerError(f"{path}: {key} {value!r} is not a token id in [0, {self.n_vocab})")
        return value

    def _resolve(self, name: str, path: Path, key: str) -> int:
        token_id = self.token_to_id(name)
        if token_id is None:
            raise TokenizerError(
                f"{path}: {key} {name!r} is neither a registered special nor a vocabulary token"
            )
        return token_id


def token_content(value: object) -> str | None:
    """A token given as a string or as a serialized AddedToken (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def frozen(mapping: Mapping[str, int]) -> Mapping[str, int]:
    """A read-only view of a private dict."""
    return MappingProxyType(dict(mapping))
