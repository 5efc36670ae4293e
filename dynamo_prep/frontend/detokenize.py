"""Incremental detokenization: token ids in, text a client may see out.

Two things make naive ``decode(new_ids)`` wrong for streaming. A token is a byte string, and one
UTF-8 character may span several tokens (CJK, emoji), so text is released only once its bytes
form whole characters (an incremental UTF-8 decoder holds the rest back). And a stop string must
never reach the client, even partly: the tail that could still grow into a stop string is held
back until the next token proves it does not, and a stop string cuts the text where it starts.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from dynamo_prep.tokenizer import Tokenizer, TokenizerError

__all__ = ["Detokenizer"]


class Detokenizer:
    """One response's text: ``push`` ids as they stream, ``finish`` at the end.

    Special tokens (EOS and the like) are skipped, as engines do by default. After a stop string
    is found ``stopped`` is True and later pushes return nothing.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = [text for text in stop if text]
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """The text these ids make visible now (possibly empty)."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(self._bytes(token_ids))
        return self._release()

    def finish(self) -> str:
        """Whatever is still held back once the stream has ended."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(b"", final=True)
        text, self._held = self._held, ""
        return text

    def _bytes(self, token_ids: Sequence[int]) -> bytes:
        tokenizer = self._tokenizer
        wanted = [token_id for token_id in token_ids if token_id not in tokenizer.all_special_ids]
        for token_id in wanted:
            if not 0 <= token_id < tokenizer.n_vocab:
                raise TokenizerError(f"token id {token_id} is out of range [0, {tokenizer.n_vocab})")
        data: bytes = tokenizer.encoding.decode_bytes(wanted)
        return data

    def _release(self) -> str:
        held = self._held
        cut = min((held.find(stop) for stop in self._stops if stop in held), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return held[:cut]
        keep = max((_overlap(held, stop) for stop in self._stops), default=0)
        released, self._held = held[: len(held) - keep], held[len(held) - keep :]
        return released


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
