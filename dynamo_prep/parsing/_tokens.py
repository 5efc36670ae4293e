"""Output ids as a parser sees them: text ids (decoded to whole characters), special ids, and junk."""

from __future__ import annotations

import codecs
import weakref

from dynamo_prep.parsing._recoveries import INVALID_TOKEN, SPECIAL_TOKEN
from dynamo_prep.tokenizer import Tokenizer


class Vocab:
    """What a parser needs to know about a tokenizer's ids, computed once per tokenizer.

    ``special_tokens`` are the strings a parser may match on their id (every one-id token: markers
    such as Qwen's ``<tool_call>`` are non-special added tokens); ``specials`` are the ids that are
    no text (the control tokens)."""

    __slots__ = ("__weakref__", "bytes_of", "n_vocab", "special_tokens", "specials", "stops")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.bytes_of = tokenizer.decode_bytes
        self.n_vocab = tokenizer.n_vocab
        self.special_tokens = tokenizer.added_tokens
        self.specials = frozenset(tokenizer.special_tokens.values())
        self.stops = frozenset(tokenizer.eos_token_ids)

    def is_text(self, token_id: int) -> bool:
        return 0 <= token_id < self.n_vocab and token_id not in self.specials

    def stray_kind(self, token_id: int) -> str | None:
        """The recovery kind of an id that is no text and no marker; None for a stop id (expected)."""
        if token_id in self.stops:
            return None
        return SPECIAL_TOKEN if 0 <= token_id < self.n_vocab else INVALID_TOKEN


_VOCABS: weakref.WeakKeyDictionary[Tokenizer, Vocab] = weakref.WeakKeyDictionary()


def vocab_of(tokenizer: Tokenizer) -> Vocab:
    vocab = _VOCABS.get(tokenizer)
    if vocab is None:
        vocab = _VOCABS[tokenizer] = Vocab(tokenizer)
    return vocab


class Utf8:
    """Bytes in, whole characters out; ``flush`` ends a stretch: an incomplete character at its end
    becomes U+FFFD, or is dropped when ``cut`` (a max_tokens cut is no malformed character)."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        text: str = self._decoder.decode(data)
        return text

    def flush(self, *, cut: bool = False) -> str:
        text: str = "" if cut else self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


def is_blank(data: bytes | bytearray) -> bool:
    """Only ASCII whitespace (a byte test, so it does not depend on how ids were chunked)."""
    return not data.strip()
