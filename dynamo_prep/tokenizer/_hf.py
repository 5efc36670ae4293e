"""Hugging Face ``tokenizer.json`` vocabularies through the ``tokenizers`` library.

A rendered prompt is encoded whole, exactly as transformers encodes it, whenever the special ids
that come out are exactly the control segments' (the common case). Otherwise some text segment
spells a special token: the prompt is encoded split at the control segments, each text span with
special tokens treated as text (``split_special_tokens`` semantics) and encoded as it sits in the
whole string (see ``_spans``). The design and its proofs are in docs/tokenizers.md.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import structlog
import tokenizers

from dynamo_prep.card import HF_TOKENIZER_FILE
from dynamo_prep.prompt import Run
from dynamo_prep.tokenizer._base import Tokenizer, TokenizerError, TokenizerSource, frozen, token_content
from dynamo_prep.tokenizer._decoding import stream_bytes_table

__all__ = ["HfTokenizer"]

log = structlog.get_logger()

# Rust's char::is_whitespace (Unicode White_Space), which tokenizers' lstrip / rstrip use.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_LEADING_SPACE = re.compile(f"^[{_WHITE_SPACE}]+")
_TRAILING_SPACE = re.compile(f"[{_WHITE_SPACE}]+$")
_NAMED_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers' clean_up_tokenization: spaces before punctuation and English contractions.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class _Special(NamedTuple):
    """A control token and how tokenizers matches it: whitespace it swallows on either side."""

    token_id: int
    lstrip: bool
    rstrip: bool


class _TextEncoders(NamedTuple):
    """The tokenizer again, for text that may spell control tokens (``encode_special_tokens``: they
    are text), as a span at the start of the string and further in (differing only for a
    first-split-only ``Metaspace``; else the same object). Never changed after the load, so every
    thread encodes on every instance at once, without a lock."""

    first: tokenizers.Tokenizer
    later: tokenizers.Tokenizer


class HfTokenizer(Tokenizer):
    """One model's ``tokenizer.json``: ``_tok`` encodes rendered prompts whole (control tokens
    matched, as transformers does), ``_text`` the spans of the traced path; none is mutated after
    the load."""

    kind = "tokenizers"
    source_file = HF_TOKENIZER_FILE

    def __init__(
        self,
        *,
        name: str,
        model_type: str | None,
        tokenizer: tokenizers.Tokenizer,
        source: Path,
        decoder: object,
        text_encoders: _TextEncoders,
        clean_up_tokenization_spaces: bool,
    ) -> None:
        self.name = name
        self.model_type = model_type
        self._tok = tokenizer
        self._text = text_encoders
        self._clean_up = clean_up_tokenization_spaces
        added = tokenizer.get_added_tokens_decoder()
        self.n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self.added_tokens = frozen({token.content: token_id for token_id, token in added.items()})
        self._specials = {
            token.content: _Special(token_id, token.lstrip, token.rstrip)
            for token_id, token in added.items()
            if token.special
        }
        self.special_tokens = frozen(
            {content: special.token_id for content, special in self._specials.items()}
        )
        self.all_special_ids = frozenset(self.special_tokens.values())
        self._cut = _alternation(self._specials)
        self._table, self.decoder_exact = stream_bytes_table(tokenizer, decoder, self.n_vocab, source)

    @classmethod
    def load(cls, source: TokenizerSource) -> HfTokenizer:
        """Load ``tokenizer.json`` with the added tokens ``tokenizer_config.json`` declares, as
        transformers does; a malformed file or an inconsistent token names the file and the field."""
        path = source.files[HF_TOKENIZER_FILE]
        text = _read_text(path)
        try:
            spec = json.loads(text)
            tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the Rust parser raises plain Exceptions
            raise TokenizerError(f"{path}: not a valid tokenizer.json: {str(exc)[:300]}") from exc
        if not isinstance(spec, dict):
            raise TokenizerError(f"{path}: not a valid tokenizer.json: not a JSON object")
        _declare_added_tokens(tokenizer, source.tokenizer_config, source.files)
        model_type = source.config.get("model_type")
        return cls(
            name=source.model_dir.resolve().name,
            model_type=model_type if isinstance(model_type, str) else None,
            tokenizer=tokenizer,
            source=path,
            decoder=spec.get("decoder"),
            text_encoders=_text_encoders(tokenizer, spec.get("pre_tokenizer"), path),
            clean_up_tokenization_spaces=_cleans_up(spec, source.tokenizer_config),
        )

    def load_facts(self) -> dict[str, Any]:
        return {"decoder_exact": self.decoder_exact}

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._whole(text, add_special_tokens=False)
        return self._traced([(text, False)])

    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self._whole(text, add_special_tokens=add_special_tokens)

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        prefix, suffix = self._added_around
        return [*prefix, *ids, *suffix]

    @functools.cached_property
    def _added_around(self) -> tuple[list[int], list[int]]:
        """What the post-processor puts before and after a sequence, read off one probe."""
        bare = self._whole("a", add_special_tokens=False)
        wrapped = self._whole("a", add_special_tokens=True)
        for start in range(len(wrapped) - len(bare) + 1):
            if wrapped[start : start + len(bare)] == bare:
                return wrapped[:start], wrapped[start + len(bare) :]
        return [], []

    def encode_pieces(self, pieces: Iterable[tuple[str, bool] | Run]) -> list[int]:
        segments = list(_segments(pieces))
        text = "".join(segment_text for segment_text, _ in segments)
        ids = self._whole(text, add_special_tokens=False)
        specials = self.special_tokens
        expected = [specials[t] for t, allow in segments if allow and t in specials]
        special_ids = self.all_special_ids
        if [token_id for token_id in ids if token_id in special_ids] == expected:
            return ids
        return self._traced(segments)

    def _whole(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def _traced(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """Control segments' specials as their ids, everything else as text that spells no special,
        each span encoded as a split of the whole string at its offset."""
        ids: list[int] = []
        first, later = self._text
        for text, special_id, offset in self._spans(segments):
            if special_id is not None:
                ids.append(special_id)
            elif text:
                ids.extend((first if offset == 0 else later).encode(text, add_special_tokens=False).ids)
        return ids

    def _spans(self, segments: Sequence[tuple[str, bool]]) -> Iterator[tuple[str, int | None, int]]:
        """``(text, special id or None, offset)`` spans, as tokenizers' added-token split makes them:
        a control token swallows the whitespace beside it that its lstrip / rstrip flags name."""
        parts: list[list[Any]] = []  # [text, _Special | None]
        for text, allow in segments:
            for piece, special in self._split(text) if allow else ((text, None),):
                if special is None and parts and parts[-1][1] is None:
                    parts[-1][0] += piece
                else:
                    parts.append([piece, special])
        for index, (_, special) in enumerate(parts):
            if special is None:
                continue
            if special.lstrip and index > 0 and parts[index - 1][1] is None:
                parts[index - 1][0] = _TRAILING_SPACE.sub("", parts[index - 1][0])
            if special.rstrip and index + 1 < len(parts) and parts[index + 1][1] is None:
                parts[index + 1][0] = _LEADING_SPACE.sub("", parts[index + 1][0])
        offset = 0
        for text, special in parts:
            yield text, None if special is None else special.token_id, offset
            offset += len(text)

    def _split(self, text: str) -> Iterator[tuple[str, _Special | None]]:
        """A control segment cut at the special tokens it holds."""
        if text in self._specials:
            yield text, self._specials[text]
            return
        start = 0
        for match in self._cut.finditer(text) if self._cut is not None else ():
            if match.start() > start:
                yield text[start : match.start()], None
            yield match.group(), self._specials[match.group()]
            start = match.end()
        if start < len(text):
            yield text[start:], None

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        bad = self.first_unknown_id(ids)
        if bad is not None:
            raise TokenizerError(f"{self.name}: token id {bad} is out of range [0, {self.n_vocab})")
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < self.n_vocab else b""

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        return max(map(len, self._table), default=1)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        table, size = self._table, self.n_vocab
        return b"".join([table[token_id] for token_id in ids if 0 <= token_id < size])

    def token_to_id(self, text: str) -> int | None:
        token_id = self.added_tokens.get(text)
        if token_id is not None:
            return token_id
        found: int | None = self._tok.token_to_id(text)
        return found

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self.n_vocab:
            return None
        token: str | None = self._tok.id_to_token(token_id)
        return token


def _cleans_up(spec: dict[str, Any], tokenizer_config: Mapping[str, Any]) -> bool:
    """transformers' decode cleans spaces before punctuation when asked, except for BPE models
    (it would corrupt their text) unless forced."""
    if tokenizer_config.get("clean_up_tokenization_spaces") is not True:
        return False
    model = spec.get("model")
    bpe = isinstance(model, dict) and model.get("type") == "BPE"
    return (
        not bpe
        or tokenizer_config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        is True
    )


def _segments(pieces: Iterable[tuple[str, bool] | Run]) -> Iterator[tuple[str, bool]]:
    for piece in pieces:
        if isinstance(piece, tuple):
            yield piece
        else:  # a Run: a formatter's constant run of segments
            yield from piece.segments


def _alternation(specials: Mapping[str, _Special]) -> re.Pattern[str] | None:
    """Specials leftmost-longest, as tokenizers' Aho-Corasick matcher finds them."""
    if not specials:
        return None
    return re.compile("|".join(re.escape(text) for text in sorted(specials, key=len, reverse=True)))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read the tokenizer: {exc}") from exc


def _declare_added_tokens(
    tokenizer: tokenizers.Tokenizer, tokenizer_config: Mapping[str, Any], files: Mapping[str, Path]
) -> None:
    """``tokenizer_config.json`` ``added_tokens_decoder`` on top of ``tokenizer.json``'s own: each
    entry must name the token the vocabulary has at that id (or the next free id); its special flag
    wins, as in transformers. The named special tokens (``bos_token``, ...) are special too."""
    path = files.get("tokenizer_config.json", Path("tokenizer_config.json"))
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder must be an object")
    have = tokenizer.get_added_tokens_decoder()
    for key, entry in sorted(decoder.items(), key=lambda item: _entry_id(item[0], item[1], path)):
        token_id = _entry_id(key, entry, path)
        added = _added_token(entry)
        existing = have.get(token_id)
        if existing is not None and existing.content == added.content and existing.special == added.special:
            continue
        _add_at(tokenizer, token_id, added, path)
    named = [token_content(tokenizer_config.get(key)) for key in _NAMED_SPECIAL_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):  # transformers 4 and 5 spellings
        listed = tokenizer_config.get(key)
        values = listed.values() if isinstance(listed, dict) else listed if isinstance(listed, list) else ()
        named.extend(token_content(value) for value in values)
    have = tokenizer.get_added_tokens_decoder()
    specials = {token.content for token in have.values() if token.special}
    missing = [text for text in named if text is not None and text not in specials]
    present = [text for text in missing if tokenizer.token_to_id(text) is not None]
    if present:
        tokenizer.add_special_tokens(present)


def _entry_id(key: object, entry: object, path: Path) -> int:
    content = entry.get("content") if isinstance(entry, dict) else None
    if not isinstance(key, str) or not key.isdigit() or not isinstance(content, str) or not content:
        raise TokenizerError(f"{path}: malformed added_tokens_decoder entry {key!r}: {str(entry)[:200]}")
    return int(key)


def _added_token(entry: Mapping[str, Any]) -> tokenizers.AddedToken:
    return tokenizers.AddedToken(
        entry["content"],
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", not entry.get("special", False))),
        special=bool(entry.get("special", False)),
    )


def _add_at(tokenizer: tokenizers.Tokenizer, token_id: int, token: tokenizers.AddedToken, path: Path) -> None:
    at = tokenizer.id_to_token(token_id)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if at is not None and at != token.content:
        raise TokenizerError(
            f"{path}: added_tokens_decoder names {token.content!r} for id {token_id}, "
            f"but {HF_TOKENIZER_FILE} has {at!r} there"
        )
    if at is None and token_id != size:
        raise TokenizerError(
            f"{path}: added_tokens_decoder entry {token_id} {token.content!r} is outside the vocabulary "
            f"of {size} ids (an added token takes the next free id)"
        )
    if token.special:
        tokenizer.add_special_tokens([token])
    else:
        tokenizer.add_tokens([token])
    if tokenizer.token_to_id(token.content) != token_id:
        raise TokenizerError(
            f"{path}: added_tokens_decoder entry {token_id} {token.content!r} lands elsewhere"
        )


def _text_encoders(tokenizer: tokenizers.Tokenizer, pre: object, path: Path) -> _TextEncoders:
    """Copies of ``tokenizer`` (its added tokens as declared) that treat control tokens as text; the
    one for later spans never prepends ``▁`` where a first-split-only ``Metaspace`` would."""
    serialized = tokenizer.to_str()
    first = tokenizers.Tokenizer.from_str(serialized)
    first.encode_special_tokens = True
    mid = _mid_pre_tokenizer(pre, path)
    if mid is None:
        return _TextEncoders(first, first)
    later = tokenizers.Tokenizer.from_str(serialized)
    later.encode_special_tokens = True
    later.pre_tokenizer = mid
    return _TextEncoders(first, later)


def _mid_pre_tokenizer(pre: object, path: Path) -> Any:
    """The pre-tokenizer for a span that does not start the string, when it differs: a SentencePiece
    ``Metaspace`` that prepends ``▁`` to the first split only (``prepend_scheme: first``) leaves later
    splits alone. None when no rule depends on the position."""
    if not isinstance(pre, dict) or not _never_prepend(pre):
        return None
    bare = {
        "version": "1.0",
        "pre_tokenizer": pre,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"},
    }
    try:
        return tokenizers.Tokenizer.from_str(json.dumps(bare)).pre_tokenizer
    except Exception as exc:
        raise TokenizerError(f"{path}: cannot read its pre_tokenizer: {str(exc)[:300]}") from exc


def _never_prepend(pre: dict[str, Any]) -> bool:
    """Rewrites every first-split-only Metaspace in ``pre`` to never prepend; True when one was."""
    changed = False
    if pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first":
        pre["prepend_scheme"] = "never"
        changed = True
    for child in pre.get("pretokenizers") or ():
        if isinstance(child, dict):
            changed = _never_prepend(child) or changed
    return changed
